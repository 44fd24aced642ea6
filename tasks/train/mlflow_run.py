"""The MLflow run of a training request: open it (or continue the unfinished one), then end it.

An unfinished run of the very same request is continued from its last checkpoint, never a
FINISHED one. An MLflow outage loses no record: the launcher completes the run, waiting up to
TRACKING_PATIENCE_S for the server (:func:`complete_run`). Apart from the launch so that every
talk with MLflow, and its retries, is in one place. Details: docs/training.md#the-mlflow-run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import tenacity
from mlflow import MlflowClient
from mlflow.entities import Param
from mlflow.exceptions import MlflowException

from models.untrained import ModelSpec
from tasks.data.git_revision import git_revision
from tasks.data.imagedir import Manifest
from tasks.data.transform import input_size
from tasks.shared.artifacts import TRAINING_REPORT, markdown_table, png_markdown, publish_markdown
from tasks.shared.errors import InvalidParameterError, TrainingFailedError
from tasks.shared.settings import Settings, redact_uri
from tasks.shared.step import step_logger
from tasks.shared.tracking import logged_value, run_url, summary_metric
from tasks.train.loop import LOSS, LR, THROUGHPUT, TOP1, TOP5, VAL_LOSS
from tasks.train.params import RunConfig, TrainParams
from tasks.train.request import CONFIG, Request
from tasks.train.run_folder import CHECKPOINT, CURVES, run_logs
from tasks.train.run_lock import in_training
from tasks.train.tracker import log_missing, transient

LOG_ARTIFACTS = "logs"
# Tag of a training run: the request it trains (RunConfig.job_key), to find it again on a retry.
RESUME_KEY_TAG = "imageops.resume_key"
# Tag of a training run started by a Prefect flow run (a deployment's, through a worker): that
# flow run's id, so that a run whose flow run ended without ending it is ended the same way
# (app.stranded_runs).
FLOW_RUN_TAG = "imageops.prefect_flow_run_id"
UNFINISHED = ("RUNNING", "FAILED", "KILLED")
# Once training has ended, how long the launcher keeps trying to write the run's last records
# while MLflow does not answer, and how long it pauses between tries (see complete_run).
TRACKING_PATIENCE_S = 600.0
TRACKING_PAUSE_S = 2.0


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


def require_run(client: MlflowClient, run_id: str) -> None:
    """A given ``run_id`` must name an MLflow run; an outage is raised as itself (a retry helps)."""
    try:
        client.get_run(run_id)
    except MlflowException as exc:
        if transient(exc):  # MLflow is down, not the run: a retry may get through
            raise
        raise InvalidParameterError(
            f"run_id = {run_id!r}: no such MLflow run.",
            "Leave run_id empty to start a new run.",
        ) from exc


def resume_or_create_run(
    client: MlflowClient,
    experiment_id: str,
    request: Request,
    settings: Settings,
    run_name: str | None,
) -> str:
    """The unfinished run of this request to continue, else a new run (parameters logged)."""
    key = request.config.job_key()
    flow_run = _flow_run_tag()
    resumable = _resumable_run(client, experiment_id, key, settings)
    if resumable is not None:
        step_logger(__name__).info(
            "continuing unfinished MLflow run %s of the same request from its checkpoint",
            resumable,
        )
        for name, value in flow_run.items():  # this flow run trains it now
            client.set_tag(resumable, name, value)
        return resumable
    config = request.decided()
    tags = _tags(request.spec, config.params, config.device, config.data_version)
    # The data md5s above and the code's revision: together they say what this run learned from.
    tags["imageops.git_revision"] = git_revision(settings.project_root)
    run_id = client.create_run(
        experiment_id,
        run_name=run_name or _default_run_name(request.spec, config.params),
        tags={**tags, RESUME_KEY_TAG: key, **flow_run},
    ).info.run_id
    # Once, here: a run that fails in its workers still shows what it was asked to do.
    _log_params(client, run_id, config, request.train_manifest, request.val_manifest)
    return run_id


def _flow_run_tag() -> dict[str, str]:
    """The tag naming the Prefect flow run this process runs, when a worker started it.

    The worker's process for a flow run has its id in ``PREFECT__FLOW_RUN_ID``: the top flow
    run of the process, whose state the worker (or the server's zombie automation) ends when the
    process dies. A command line run has none: its flow runs live on a temporary server.
    """
    flow_run = os.environ.get("PREFECT__FLOW_RUN_ID")
    return {FLOW_RUN_TAG: flow_run} if flow_run else {}


def _resumable_run(
    client: MlflowClient, experiment_id: str, key: str, settings: Settings
) -> str | None:
    """The newest run of request ``key`` that ended unfinished with a checkpoint to resume from.

    RUNNING counts as unfinished (a launcher killed hard never set the final status), but not
    while a launcher holds the run's lock: that run is being trained now, by someone else.
    """
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{RESUME_KEY_TAG}` = '{key}'",
        order_by=["attributes.start_time DESC"],
        max_results=50,
    )
    for run in runs:
        run_dir = settings.runs_dir / run.info.run_id
        if run.info.status not in UNFINISHED or not _has_checkpoint(run_dir, settings):
            continue
        if not in_training(run_dir):
            return run.info.run_id
    return None


def _has_checkpoint(run_dir: Path, settings: Settings) -> bool:
    """In the run folder here, or in the checkpoint store (a cluster job's, trained elsewhere)."""
    from tasks.train.checkpoint_store import stored_checkpoint

    return (run_dir / CHECKPOINT).is_file() or stored_checkpoint(run_dir.name, settings)


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
        "memory_efficient": config.architecture.memory_efficient,
        "zero_init_residual": config.architecture.zero_init_residual,
        "world_size": config.world_size,
        "effective_learning_rate": logged_value(config.params.learning_rate * config.world_size),
        "device": config.device,
        "resolved_precision": config.precision,
        "num_classes": len(config.classes),
        "train_images": len(train_manifest.images),
        "val_images": len(val_manifest.images),
        "input_size": input_size(config.transform),
        **{f"transform.{k}": v for k, v in config.transform.model_dump().items()},
    }
    client.log_batch(run_id, params=[Param(k, str(v)) for k, v in values.items()])


# The report's per-epoch table: short headings, so it fits the Prefect UI's artifact panel
# (every metric, per process too, is in the MLflow run).
REPORT_COLUMNS = {
    LOSS: "train loss", VAL_LOSS: "val loss", TOP1: "top-1", TOP5: "top-5",
    THROUGHPUT: "images/s", LR: "learning rate",
}  # fmt: skip


def report_rows(history: list[dict[str, float]]) -> list[dict[str, object]]:
    """The per-epoch table as people read it: accuracies in %, throughput in whole images."""
    rows = []
    for epoch in history:
        row: dict[str, object] = {"epoch": int(epoch["epoch"])}
        for key, heading in REPORT_COLUMNS.items():
            value = epoch.get(key)
            if value is not None and key in (TOP1, TOP5):
                value = f"{100 * value:.1f}%"
            elif value is not None and key == THROUGHPUT:
                value = round(value)
            row[heading] = "" if value is None else value
        rows.append(row)
    return rows


def publish_report(run_id: str, run_dir: Path, result: dict[str, Any], settings: Settings) -> None:
    """The training curves, per-epoch metrics and where each rank's log is, as an artifact."""
    rows = report_rows(result.get("history", []))
    logs_page = run_url(settings, run_id, "artifacts")
    logs = "\n".join(f"- `{path.name}`: `{path}`" for path in run_logs(run_dir))
    if logs:
        copies = (
            f"[{LOG_ARTIFACTS}/ in the MLflow run]({logs_page})"
            if logs_page
            else (f"`{LOG_ARTIFACTS}/` in the MLflow run's artifacts")
        )
        logs = f"Per-rank logs (rank_0 is the master; copies in {copies}):\n\n{logs}"
    markdown = "\n\n".join(
        part
        for part in (
            f"### Training run `{run_id}` (best epoch {result['best_epoch']})",
            png_markdown(run_dir / CURVES, "training curves"),
            markdown_table(rows),
            logs,
        )
        if part
    )
    publish_markdown(TRAINING_REPORT, markdown, f"Training curves of MLflow run {run_id}")


class Outcome:
    """What the block under :func:`ending_run` trained: ``result`` once it has one."""

    result: dict[str, Any] | None = None


@contextmanager
def ending_run(
    client: MlflowClient, which: Callable[[], tuple[str | None, Path]]
) -> Iterator[Outcome]:
    """End the MLflow run ``which()`` names however the block ends (:func:`complete_run`).

    FINISHED with the block's result, FAILED on an error, KILLED on Ctrl-C or a cancelled flow
    run's TerminationSignal (stopped, not failed). ``which`` is asked at the end: a cluster job
    opens its run only once the gang has decided the precision.
    """
    outcome, status = Outcome(), "FAILED"
    try:
        yield outcome
        if outcome.result is not None:
            status = "FINISHED"
    except BaseException as stop:
        if not isinstance(stop, Exception):
            status = "KILLED"
        raise
    finally:
        run_id, run_dir = which()
        if run_id is not None:
            complete_run(client, run_id, run_dir, outcome.result, status)


def complete_run(
    client: MlflowClient,
    run_id: str,
    run_dir: Path,
    result: dict[str, Any] | None,
    status: str,
) -> None:
    """Write the run's last records to MLflow and end it with ``status``, outlasting an outage.

    A trained run gets the epochs' metrics it lacks, the best epoch's, the curves and every rank's
    log, then FINISHED; each call is retried for up to TRACKING_PATIENCE_S (10 minutes), after which
    the run, still RUNNING, is an error a retry completes. A failed or stopped run gets one try of
    each. Details: docs/training.md#complete_run.
    """
    patience = TRACKING_PATIENCE_S if status == "FINISHED" else 0.0
    deadline = time.monotonic() + patience
    if result is not None:
        best = {
            "epoch": float(result["epochs_trained"]),
            summary_metric("best", TOP1): result["metrics"][TOP1],
            summary_metric("best", "epoch"): float(result["best_epoch"]),
        }
        history = [*result["history"], best]
        _patiently(lambda: log_missing(client, run_id, history), "the metrics", deadline)
        if (run_dir / CURVES).is_file():
            curves = str(run_dir / CURVES)
            _patiently(lambda: client.log_artifact(run_id, curves), CURVES, deadline)
    # torchrun.log on one machine; on a cluster, one per node, named by the ranks it ran.
    for path in [*run_logs(run_dir), run_dir / CONFIG]:
        if path.is_file():
            _patiently(
                lambda p=str(path): client.log_artifact(run_id, p, artifact_path=LOG_ARTIFACTS),
                path.name,
                deadline,
            )
    ended = _patiently(lambda: client.set_terminated(run_id, status), "the status", deadline)
    if not ended and status == "FINISHED":
        raise TrainingFailedError(
            f"Training finished and wrote its model, but MLflow did not take the end of run "
            f"{run_id} within {patience:.0f} s; the run stays RUNNING.",
            "Check the MLflow server, then run the same request again: it resumes this run, "
            "trains nothing more and completes its record.",
        )


def _patiently(call: Callable[[], object], what: str, deadline: float) -> bool:
    """Call ``call`` until it succeeds, a failure is not transient, or ``deadline`` passes.

    True when it succeeded. A failure is never raised, whatever it is (a record must never hide
    the training's own outcome): it is a warning, and the caller decides what it means.
    """
    log = step_logger(__name__)
    waited_since: list[float] = []  # when the first transient failure came

    def waiting(state: tenacity.RetryCallState) -> None:
        if not waited_since:
            waited_since.append(time.monotonic())
            log.warning(
                "MLflow did not take %s; trying again every %g s for up to %.0f s: %s",
                what,
                TRACKING_PAUSE_S,
                deadline - waited_since[0],
                redact_uri(str(state.outcome.exception())),  # MLflow quotes the tracking URI
            )

    retrying = tenacity.Retrying(
        stop=lambda _: time.monotonic() >= deadline,
        wait=tenacity.wait_fixed(TRACKING_PAUSE_S),
        retry=tenacity.retry_if_exception(transient),
        before_sleep=waiting,
        reraise=True,
    )
    try:
        retrying(call)
    except Exception as exc:
        log.warning("MLflow did not take %s; giving up: %s", what, redact_uri(str(exc)))
        return False
    if waited_since:
        log.info("MLflow took %s after %.0f s", what, time.monotonic() - waited_since[0])
    return True
