"""Train PyTorch Model: check every input, open the MLflow run, run torchrun, collect the result.

This module puts the steps in order; each job is in a module of its own (:mod:`.request`,
:mod:`.mlflow_run`, :mod:`.run_lock`, :mod:`.torchrun`, and :mod:`.cluster` for a job of many
nodes on a Ray cluster).
Details: docs/training.md#the-package.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from pydantic import BaseModel

from tasks.shared.errors import InvalidParameterError
from tasks.shared.log_tail import read_from
from tasks.shared.settings import Settings, get_settings
from tasks.shared.step import name_flow_run, step, step_logger, tasks_on_first_use
from tasks.shared.tracking import configure_mlflow
from tasks.train.failure import clear_failures
from tasks.train.mlflow_run import ending_run, publish_report, require_run, resume_or_create_run
from tasks.train.params import RunConfig
from tasks.train.request import CONFIG, TrainRequest, check_request
from tasks.train.retention import discard_checkpoints
from tasks.train.run_folder import RESULT
from tasks.train.run_lock import launch_lock, output_lock
from tasks.train.torchrun import (
    TORCHRUN_LOG,
    run_torchrun,
    torchrun_command,
    torchrun_environment,
    torchrun_failure,
    torchrun_threads,
)
from tasks.train.watch import TrainingWatch, finished_line


class TrainResult(BaseModel):
    """What a training run produced: the ModelDirectory, its MLflow run, its best metrics."""

    model_dir: Path
    run_id: str
    metrics: dict[str, float]
    best_epoch: int
    run_dir: Path
    # Every epoch's metrics, in order (what a tuning trial measures its value from).
    history: list[dict[str, float]] = []
    # A tuning trial stopped early for being worse than the median (the model is still written).
    pruned: bool = False


def epochs_text(epochs: int) -> str:
    """``1 epoch``, ``5 epochs``: how the training's name and progress say it."""
    return f"{epochs} epoch" + ("s" if epochs != 1 else "")


def training_run_name(arch: str, epochs: int) -> str:
    """The training's Prefect run name, ``training-resnet18-5-epochs``: given from the request
    before the run starts (flows.train) and again once the request is checked (here)."""
    return f"training-{arch}-{epochs_text(epochs).replace(' ', '-')}"


def train(
    request: TrainRequest, settings: Settings | None = None, *, watched: bool = False
) -> TrainResult:
    """Train ``request.model`` on its training data, validating on its validation data.

    ``request.out`` receives the ModelDirectory of the best validation top-1 epoch; the MLflow run
    gets parameters, metrics, curves and logs. The run is ``request.run_id``, or the unfinished run
    of this very request (a retry trains only the epochs it lacks), or a new one. With
    ``params.cluster`` the job runs on that Ray cluster (:mod:`.cluster`), else torchrun here.
    ``watched``: the training is its Prefect run's whole work (the train flow), so the run is named
    after it and shows its progress (:mod:`.watch`); a tuning trial's training is not.
    Details: docs/training.md#train. Raises the Azure input errors (InvalidModelDirectoryError,
    ...) before anything starts, a worker's ImageOpsError, else TrainingFailedError.
    """
    settings = settings or get_settings()
    with output_lock(request.out, settings):
        return _train(request, settings, watched)


def _train(request: TrainRequest, settings: Settings, watched: bool) -> TrainResult:
    log = step_logger(__name__)  # inside a Prefect run, these lines reach the UI
    if request.params.cluster:
        from tasks.train.cluster import train_on_cluster

        run_id, run_dir, result = train_on_cluster(request, settings)
        log.info(finished_line(result))
        return _as_result(result, request.out, run_id, run_dir)
    checked = check_request(request, settings)
    arch = checked.spec.arch
    if watched:
        name_flow_run(training_run_name(arch, request.params.epochs))
    experiment_id = configure_mlflow(settings)
    client = MlflowClient(settings.tracking_uri, settings.registry_uri)
    run_id = request.run_id
    if run_id is None:
        run_id = resume_or_create_run(client, experiment_id, checked, settings, request.run_name)
    else:
        require_run(client, run_id)
    run_dir = settings.runs_dir / run_id
    config = checked.bind(run_id, run_dir)
    if request.tuning is not None:
        config = config.model_copy(update={"tuning": request.tuning})
    log.info("MLflow run %s, run folder %s", run_id, run_dir)
    torchrun_log = run_dir / TORCHRUN_LOG
    with launch_lock(run_dir, run_id):
        client.update_run(run_id, status="RUNNING")
        with ending_run(client, lambda: (run_id, run_dir)) as outcome:
            config_path = _write_config(run_dir, config)
            command = torchrun_command(request, config_path, run_id)
            threads = torchrun_threads(request.params.nproc_per_node)
            env = torchrun_environment(settings, run_id, {**threads, **request.env})
            offset = torchrun_log.stat().st_size if torchrun_log.is_file() else 0
            label = f"{arch}, {epochs_text(request.params.epochs)}"
            watch = TrainingWatch.start(label) if watched else None
            returncode = run_torchrun(command, env, run_dir, request.timeout_s, on_line=watch)
            if returncode != 0:
                output = read_from(torchrun_log, offset)
                raise torchrun_failure(run_dir, returncode, torchrun_log, output)
            outcome.result = result = json.loads((run_dir / RESULT).read_text())
        # Still under the lock: MLflow has the run FINISHED, so nothing resumes it any more.
        discard_checkpoints(run_id, run_dir, settings)
    if watch is not None:
        watch.move(100.0)  # stopped early, or the last progress line was before the end
    log.info(finished_line(result))
    publish_report(run_id, run_dir, result, settings)
    return _as_result(result, request.out, run_id, run_dir)


def _as_result(result: dict[str, Any], out: Path, run_id: str, run_dir: Path) -> TrainResult:
    return TrainResult(
        model_dir=Path(out).resolve(),
        run_id=run_id,
        metrics=result["metrics"],
        best_epoch=result["best_epoch"],
        run_dir=run_dir,
        history=result.get("history", []),
        pruned=bool(result.get("pruned", False)),
    )


def open_run(request: TrainRequest, settings: Settings | None = None) -> str:
    """Check the training request in full and return the id of the MLflow run to train it in.

    An unfinished run of the same request with a checkpoint, that no launcher trains now, is
    continued (a retry resumes); a FINISHED run never is; otherwise a new run is created. A
    tuning trial opens its run with this before it trains. Raises what :func:`train` raises
    before it starts. Details: docs/training.md#open_run.
    """
    settings = settings or get_settings()
    checked = check_request(request, settings)
    experiment_id = configure_mlflow(settings)
    client = MlflowClient(settings.tracking_uri, settings.registry_uri)
    return resume_or_create_run(client, experiment_id, checked, settings, request.run_name)


def _write_config(run_dir: Path, config: RunConfig) -> Path:
    """Save the config; a run folder that already has one must hold the same job."""
    path = run_dir / CONFIG
    if path.is_file():
        existing = RunConfig.load(path)
        if existing.digest() != config.digest():
            mine, theirs = config.model_dump(mode="json"), existing.model_dump(mode="json")
            changed = sorted(k for k in mine if mine[k] != theirs.get(k))
            raise InvalidParameterError(
                f"Run {config.mlflow_run_id} was started with a different configuration "
                f"(differs in: {', '.join(changed)}).",
                "Resume with the same model, data and parameters, or start a new run.",
            )
    run_dir.mkdir(parents=True, exist_ok=True)
    # Left-overs of an earlier launch of this run must not be read as this launch's outcome.
    clear_failures(run_dir)
    (run_dir / RESULT).unlink(missing_ok=True)
    return config.save(path)


__getattr__ = tasks_on_first_use(
    globals(),
    train_task=lambda: step(train, name="train"),
)
