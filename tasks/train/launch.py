"""Train PyTorch Model: check every input, open the MLflow run, run torchrun, collect the result.

Everything the seed refuses is refused here, before a process starts or a run is created: a folder
that is not an untrained model (InvalidModelDirectoryError), unlabeled training data
(NotLabeledDatasetError), different classes in training and validation (InvalidDatasetError), a
batch larger than the training set, CUDA without a GPU, more processes per node than GPUs.

torchrun runs as a subprocess in a session of its own (fork inside a Prefect task can deadlock on
Prefect's threads), and on a timeout, an interrupt or any error the whole process tree is
stopped, so no orphaned worker keeps a GPU or a port. A worker's ImageOpsError comes back as the
same error class; any other failure as a TrainingFailedError quoting the log.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import psutil
import torch
from mlflow import MlflowClient
from mlflow.entities import Param
from mlflow.exceptions import MlflowException
from pydantic import BaseModel

import tasks
from models.directory import Preprocessing
from models.zoo import ModelSpec, build_model, pretrained_weights_path, read_untrained
from tasks.artifacts import markdown_table, png_markdown, publish_markdown
from tasks.errors import (
    ImageOpsError,
    InvalidDatasetError,
    InvalidParameterError,
    TrainingFailedError,
)
from tasks.imagedir import Manifest, read_manifest, require_labeled, require_same_classes
from tasks.settings import Settings, get_settings
from tasks.step import step, step_logger
from tasks.tracking import configure_mlflow
from tasks.train.failure import clear_failures, read_failures
from tasks.train.params import RunConfig, TrainParams, manifest_fingerprint
from tasks.train.worker import CURVES, RESULT, rank_log

CONFIG = "config.json"
TORCHRUN_LOG = "torchrun.log"
LOG_ARTIFACTS = "logs"
KILL_GRACE_S = 15.0
TAIL_LINES = 25


class TrainResult(BaseModel):
    """What a training run produced: the ModelDirectory, its MLflow run, its best metrics."""

    model_dir: Path
    run_id: str
    metrics: dict[str, float]
    best_epoch: int
    run_dir: Path


def train(
    model: Path,
    train_data: Path,
    val_data: Path,
    out: Path,
    params: TrainParams | Mapping[str, Any],
    *,
    preprocessing: Preprocessing,
    settings: Settings | None = None,
    data_version: dict[str, str] | None = None,
    run_name: str | None = None,
    run_id: str | None = None,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 1,
    timeout_s: float | None = None,
) -> TrainResult:
    """Train the untrained ``model`` on ``train_data``, validating on ``val_data``; write ``out``.

    ``out`` receives the ModelDirectory of the epoch with the best validation top-1. The MLflow run
    (created here, named ``run_name``) gets the parameters, per-epoch metrics, the training curves
    and every rank's log; its folder ``settings.runs_dir/<run id>`` keeps config, checkpoint and
    logs. ``run_id`` continues an existing run instead (resume after a crash from its last
    checkpoint, or join a multi-node run whose rendezvous is ``rdzv_endpoint`` host:port).
    torchrun restarts crashed workers up to ``max_restarts`` times, resuming from the checkpoint;
    ``timeout_s`` bounds the whole run.

    Raises the seed's InvalidModelDirectoryError, NotLabeledDatasetError, InvalidDatasetError,
    InvalidParameterError before anything starts; a worker's ImageOpsError as itself; any other
    failure as TrainingFailedError naming the log folder.
    """
    settings = settings or get_settings()
    log = step_logger(__name__)  # inside a Prefect run, these lines reach the UI
    values = params.model_dump() if isinstance(params, TrainParams) else dict(params)
    params = TrainParams.checked(**values)  # also catches model_construct()ed or dict params
    spec = read_untrained(Path(model))
    train_manifest, val_manifest = _check_datasets(Path(train_data), Path(val_data))
    _check_sizes(params, train_manifest)
    device = _resolve_device(params)
    if params.nodes > 1 and not rdzv_endpoint:
        raise InvalidParameterError(
            f"nodes = {params.nodes} needs a rendezvous endpoint; none was given.",
            "Pass rdzv_endpoint='host:port' of the first node, the same on every node.",
        )
    if max_restarts < 0:
        raise InvalidParameterError(f"max_restarts = {max_restarts}, expected an integer >= 0.")
    if spec.pretrained:
        _ensure_pretrained_weights(spec, settings)

    experiment_id = configure_mlflow(settings)
    client = MlflowClient(settings.tracking_uri, settings.registry_uri)
    created = run_id is None
    if run_id is None:
        run_id = client.create_run(
            experiment_id,
            run_name=run_name or _default_run_name(spec, params),
            tags=_tags(spec, params, device, data_version or {}),
        ).info.run_id
    else:
        _reopen_run(client, run_id)
    run_dir = settings.runs_dir / run_id
    log.info("MLflow run %s, run folder %s", run_id, run_dir)
    status = "FAILED"
    try:
        config = RunConfig(
            params=params,
            architecture=spec,
            classes=train_manifest.classes,
            preprocessing=preprocessing,
            train_data=Path(train_data).resolve(),
            val_data=Path(val_data).resolve(),
            data_fingerprint={
                "train": manifest_fingerprint(train_data),
                "val": manifest_fingerprint(val_data),
            },
            data_version=data_version or {},
            out=Path(out).resolve(),
            run_dir=run_dir,
            mlflow_run_id=run_id,
            device=device,
            world_size=params.world_size,
        )
        config_path = _write_config(run_dir, config)
        if created:
            _log_params(client, run_id, config, train_manifest, val_manifest)
        command = _torchrun_command(params, config_path, run_id, rdzv_endpoint, max_restarts)
        env = {
            **os.environ,
            **settings.environment(),
            "MLFLOW_RUN_ID": run_id,
            "PYTHONUNBUFFERED": "1",  # stream the workers' lines as they come
            # Workers import `tasks` by module name, whatever the working folder.
            "PYTHONPATH": os.pathsep.join(
                p for p in (_source_root(), os.environ.get("PYTHONPATH", "")) if p
            ),
        }
        returncode = _run_torchrun(command, env, run_dir, timeout_s)
        if returncode != 0:
            raise _failure(run_dir, returncode)
        if not (run_dir / RESULT).is_file():  # e.g. rank 0 ran on another node's disk
            raise TrainingFailedError(
                f"torchrun succeeded but rank 0 left no {RESULT} in {run_dir}.",
                "Multi-node runs need the run folder and the output on shared storage.",
            )
        result = json.loads((run_dir / RESULT).read_text())
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        _attach_logs(client, run_id, run_dir)
        client.set_terminated(run_id, status)
    log.info("training finished: %s", result["metrics"])
    _publish_report(run_id, run_dir, result)
    return TrainResult(
        model_dir=Path(out).resolve(),
        run_id=run_id,
        metrics=result["metrics"],
        best_epoch=result["best_epoch"],
        run_dir=run_dir,
    )


train_task = step(train, name="train")


def _check_datasets(train_data: Path, val_data: Path) -> tuple[Manifest, Manifest]:
    train_manifest = read_manifest(train_data)
    require_labeled(train_manifest, "training", train_data)
    val_manifest = read_manifest(val_data)
    require_labeled(val_manifest, "validation", val_data)
    require_same_classes(train_manifest, val_manifest)
    if not val_manifest.images:
        raise InvalidDatasetError(
            f"The validation dataset {val_data} has no images.",
            "Split with a fraction below 1 so the second half keeps some images.",
        )
    return train_manifest, val_manifest


def _check_sizes(params: TrainParams, train_manifest: Manifest) -> None:
    images = len(train_manifest.images)
    if params.batch_size > images:
        raise InvalidParameterError(
            f"batch_size = {params.batch_size} is larger than the training set ({images} images).",
            f"Use a batch size of at most {images}.",
        )
    if images <= params.world_size:
        # Each process needs 2 images or more: BatchNorm cannot train on a batch of one.
        raise InvalidParameterError(
            f"{params.world_size} processes (nodes x nproc_per_node) need more than {images} "
            "training images: each process trains on at least 2.",
            "Use fewer processes, or more training data.",
        )


def _resolve_device(params: TrainParams) -> str:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = params.device if params.device != "auto" else ("cuda" if gpus else "cpu")
    if device == "cuda" and gpus == 0:
        raise InvalidParameterError(
            "device = 'cuda', but no CUDA GPU is visible here (0 GPUs).",
            "Use device='cpu' (or 'auto'), or run on a machine with a GPU.",
        )
    if device == "cuda" and params.nproc_per_node > gpus:
        raise InvalidParameterError(
            f"nproc_per_node = {params.nproc_per_node} is more than the {gpus} GPU(s) visible "
            "on this node.",
            f"Use at most {gpus} processes per node on GPU (one per GPU).",
        )
    if device == "cpu" and params.nproc_per_node > (os.cpu_count() or 1):
        step_logger(__name__).warning(
            "nproc_per_node = %d is more than the %s CPU cores here: training will be slow.",
            params.nproc_per_node,
            os.cpu_count(),
        )
    return device


def _ensure_pretrained_weights(spec: ModelSpec, settings: Settings) -> None:
    """Fetch the pretrained weights once, here, rather than in every worker at once.

    A missing file then fails before any run exists, with PretrainedWeightsMissingError naming
    the path, instead of as a worker traceback.
    """
    # Workers get TORCH_HOME = settings.torch_home, and torch.hub's cache is <TORCH_HOME>/hub.
    cached = settings.torch_home / "hub" / "checkpoints" / pretrained_weights_path(spec.arch).name
    if cached.is_file():
        return
    previous = os.environ.get("TORCH_HOME")
    os.environ["TORCH_HOME"] = str(settings.torch_home)
    try:
        build_model(spec, num_classes=2)  # downloads into the cache, or raises with the path
    finally:
        if previous is None:
            os.environ.pop("TORCH_HOME", None)
        else:
            os.environ["TORCH_HOME"] = previous


def _default_run_name(spec: ModelSpec, params: TrainParams) -> str:
    return (
        f"{spec.arch} e{params.epochs} b{params.batch_size}x{params.world_size} "
        f"lr{params.learning_rate:g}"
    )


def _tags(
    spec: ModelSpec, params: TrainParams, device: str, data_version: dict[str, str]
) -> dict[str, str]:
    tags = {
        "imageops.step": "train",
        "imageops.architecture": spec.arch,
        "imageops.pretrained": str(spec.pretrained).lower(),
        "imageops.device": device,
        "imageops.world_size": str(params.world_size),
    }
    tags |= {f"imageops.data_version.{name}": value for name, value in data_version.items()}
    return tags


def _reopen_run(client: MlflowClient, run_id: str) -> None:
    try:
        client.get_run(run_id)
    except MlflowException as exc:
        raise InvalidParameterError(
            f"run_id = {run_id!r}: no such MLflow run.",
            "Leave run_id empty to start a new run.",
        ) from exc
    client.update_run(run_id, status="RUNNING")


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


def _log_params(
    client: MlflowClient,
    run_id: str,
    config: RunConfig,
    train_manifest: Manifest,
    val_manifest: Manifest,
) -> None:
    """The parameters, once, from the launcher: a run that fails in its workers still has them."""
    values: dict[str, Any] = {
        **config.params.model_dump(),
        "architecture": config.architecture.arch,
        "pretrained": config.architecture.pretrained,
        "world_size": config.world_size,
        "effective_learning_rate": config.params.learning_rate * config.world_size,
        "device": config.device,
        "num_classes": len(config.classes),
        "train_images": len(train_manifest.images),
        "val_images": len(val_manifest.images),
        "resize": config.preprocessing.resize,
        "center_crop": config.preprocessing.center_crop,
    }
    client.log_batch(run_id, params=[Param(k, str(v)) for k, v in values.items()])


def _source_root() -> str:
    return str(Path(tasks.__file__).resolve().parent.parent)


def _torchrun_command(
    params: TrainParams,
    config_path: Path,
    run_id: str,
    rdzv_endpoint: str | None,
    max_restarts: int,
) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run"]
    if params.nodes == 1:
        command += ["--standalone", "--nnodes", "1"]
    else:
        # Every node runs this same command; c10d rendezvous on the first node assigns ranks.
        command += [
            "--nnodes",
            str(params.nodes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            str(rdzv_endpoint),
            "--rdzv-id",
            run_id,
        ]
    command += [
        "--nproc-per-node",
        str(params.nproc_per_node),
        "--max-restarts",
        str(max_restarts),
        "-m",
        "tasks.train.worker",
        "--config",
        str(config_path),
    ]
    return command


def _pump(stream: IO[str], path: Path) -> None:
    """Copy torchrun's output to the console and to ``torchrun.log``, line by line."""
    with open(path, "a", encoding="utf-8") as sink:
        for line in stream:
            sys.stdout.write(line)
            sys.stdout.flush()
            sink.write(line)
            sink.flush()


def _run_torchrun(
    command: list[str], env: dict[str, str], run_dir: Path, timeout_s: float | None
) -> int:
    step_logger(__name__).info("starting: %s", " ".join(command))
    proc = subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        encoding="utf-8",
        errors="replace",
        bufsize=1,
        start_new_session=True,  # its own process group: we can stop all of it, and only it
    )
    assert proc.stdout is not None
    pump = threading.Thread(target=_pump, args=(proc.stdout, run_dir / TORCHRUN_LOG), daemon=True)
    pump.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            try:
                # Short waits keep this thread responsive to an interrupt or a cancellation.
                returncode = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() > deadline:
                    raise TrainingFailedError(
                        f"Training ran longer than timeout_s = {timeout_s} s and was stopped.",
                        f"The checkpoint and logs are in {run_dir}; resume with run_id, or allow "
                        "more time.",
                    ) from None
    except BaseException:
        _stop_process_tree(proc)
        raise
    finally:
        pump.join(timeout=10)
    return returncode


def _stop_process_tree(proc: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM torchrun's process group and every descendant, then SIGKILL what remains.

    torchrun starts each worker in a session of its own, so the group alone would miss them: the
    descendants are listed first, while torchrun still links them.
    """
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    _signal_group(proc.pid, signal.SIGTERM)
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(descendants, timeout=grace_s)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=1.0)
    _signal_group(proc.pid, signal.SIGKILL)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    proc.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pgid, sig)


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def _failure(run_dir: Path, returncode: int) -> ImageOpsError:
    """The error to raise for a failed torchrun: the worker's own error class when it had one."""
    failures = read_failures(run_dir)
    for failure in failures:
        error = failure.as_error()
        if error is not None:
            return error
    if failures:
        first = failures[0]
        where = rank_log(run_dir, first.rank)
        what = f"rank {first.rank} failed with {first.type}: {first.message}"
    else:  # killed by a signal, or died before its logging started
        where = rank_log(run_dir, 0)
        what = f"torchrun exited with code {returncode}"
        if not where.is_file():
            where = run_dir / TORCHRUN_LOG
    return TrainingFailedError(
        f"Training failed: {what}. Last lines of {where}:\n{_tail(where)}",
        f"Every rank's log is in {run_dir} (rank_0.log is the master's).",
    )


def _publish_report(run_id: str, run_dir: Path, result: dict[str, Any]) -> None:
    """The training curves and per-epoch metrics as a Prefect artifact (inside a Prefect run)."""
    rows = [{"epoch": int(h.pop("epoch")), **h} for h in map(dict, result.get("history", []))]
    markdown = "\n\n".join(
        part
        for part in (
            f"### Training run `{run_id}` (best epoch {result['best_epoch']})",
            png_markdown(run_dir / CURVES, "training curves"),
            markdown_table(rows),
        )
        if part
    )
    publish_markdown("training-report", markdown, f"Training curves of MLflow run {run_id}")


def _attach_logs(client: MlflowClient, run_id: str, run_dir: Path) -> None:
    """Every rank's log (and torchrun's) to the run's ``logs`` artifacts, even after a failure."""
    paths = [*sorted(run_dir.glob("rank_*.log")), run_dir / TORCHRUN_LOG, run_dir / CONFIG]
    for path in paths:
        if not path.is_file():
            continue
        try:
            client.log_artifact(run_id, str(path), artifact_path=LOG_ARTIFACTS)
        except Exception as exc:  # never hide the training's own outcome behind this
            step_logger(__name__).warning(
                "could not attach %s to MLflow run %s: %s", path, run_id, exc
            )
