"""Train PyTorch Model: check every input, open the MLflow run, run torchrun, collect the result.

Everything the seed refuses is refused here, before a process starts or a run is created: a folder
that is not an untrained model (InvalidModelDirectoryError), unlabeled training data
(NotLabeledDatasetError), different classes in training and validation (InvalidDatasetError), a
batch larger than the training set, CUDA without a GPU, more processes per node than GPUs, a
transform spec that would train and score at different sizes (InvalidTransformationDirectoryError).

torchrun runs as a subprocess in a session of its own (fork inside a Prefect task can deadlock on
Prefect's threads), and on a timeout, an interrupt or any error the whole process tree is
stopped, so no orphaned worker keeps a GPU or a port. A launcher killed outright (SIGKILL, the
OOM killer) stops nothing itself: torchrun and its workers die with it by a parent-death signal
(:mod:`tasks.parent_death`). A worker's ImageOpsError comes back as the
same error class; any other failure as a TrainingFailedError quoting the log.

Which MLflow run a request trains in is decided here too (:func:`open_run`): an unfinished run of
the very same request is continued from its last per-epoch checkpoint (a Prefect retry, or the
request run again after a crash), never a FINISHED one. A multi-node job opens its run once and
runs :func:`train` once per node against it; the torchruns meet by c10d rendezvous.

An MLflow server that goes down loses no record. Before training, the run is created (or found)
and its parameters logged: if the server does not answer within the client's retries, the
request fails with nothing trained, and a retry starts it again. During training, rank 0 never
waits long on MLflow (:mod:`tasks.train.tracker`); once training ends, the launcher writes what
the run lacks and its status, waiting up to TRACKING_PATIENCE_S (10 minutes) for the server
(:func:`_complete_run`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil
import torch
from mlflow import MlflowClient
from mlflow.entities import Param
from mlflow.exceptions import MlflowException
from pydantic import BaseModel

import tasks
from models.atomic import check_destination, write_json
from models.transform_spec import AppliedTransform, TransformSpec
from models.untrained import MODEL_JSON, ModelSpec, read_untrained
from models.zoo import build_model, pretrained_weights_path
from tasks.artifacts import markdown_table, png_markdown, publish_markdown
from tasks.errors import (
    ImageOpsError,
    InvalidDatasetError,
    InvalidParameterError,
    RendezvousTimeoutError,
    TrainingFailedError,
)
from tasks.imagedir import Manifest, read_manifest, require_labeled, require_same_classes
from tasks.log_tail import tail
from tasks.parent_death import dying_with_this_process
from tasks.settings import Settings, get_settings, redact_uri
from tasks.step import step, step_logger
from tasks.tracking import configure_mlflow, run_url
from tasks.train.checkpoint import CHECKPOINT
from tasks.train.failure import clear_failures, read_failures
from tasks.train.loop import TOP1
from tasks.train.params import RunConfig, TrainParams, TrialHook, manifest_fingerprint
from tasks.train.precision import resolve_precision
from tasks.train.tracker import log_missing, transient
from tasks.train.worker import CURVES, RESULT, rank_log
from tasks.transform import (
    check_applied,
    data_transform,
    input_size,
    read_transformation,
    transform_spec,
)
from tasks.versioning import git_revision

CONFIG = "config.json"
TORCHRUN_LOG = "torchrun.log"
LOG_ARTIFACTS = "logs"
KILL_GRACE_S = 15.0
# torchrun's own default for how long nodes wait for each other at the rendezvous.
RDZV_TIMEOUT_S = 600
# What torchrun prints when its rendezvous times out / cannot reach the store.
RDZV_TIMEOUT_MARK = "RendezvousTimeoutError"
RDZV_CONNECTION_MARK = "RendezvousConnectionError"
CLOCK_SLACK_S = 1.0
# Tag of a training run: the request it trains (RunConfig.job_key), to find it again on a retry.
RESUME_KEY_TAG = "imageops.resume_key"
UNFINISHED = ("RUNNING", "FAILED", "KILLED")
LAUNCH_LOCK = "launch.lock"
NODES = "nodes"  # in the run folder: when each node's torchrun ran
# Once training has ended, how long the launcher keeps trying to write the run's last records
# while MLflow does not answer, and how long it pauses between tries (see _complete_run).
TRACKING_PATIENCE_S = 600.0
TRACKING_PAUSE_S = 2.0


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


@dataclass(frozen=True)
class _Request:
    """A training request checked in full and resolved, before any MLflow run exists.

    ``config`` is not bound to a run yet (``run_dir`` is the runs folder, no run id): its
    :meth:`~tasks.train.params.RunConfig.job_key` is what finds an unfinished run to continue.
    """

    spec: ModelSpec
    config: RunConfig  # with ``precision`` still to decide when "auto" (see :meth:`decided`)
    train_manifest: Manifest
    val_manifest: Manifest

    def decided(self, run_dir: Path | None = None) -> RunConfig:
        """The config with "auto" precision decided once per run, never again on a resume.

        A run folder that already holds this job's ``config.json`` (a retry, a restart on a
        busier machine) keeps the precision recorded there; else it is decided now, which on
        CPU times a small convolution both ways.
        """
        params = self.config.params
        if params.precision != "auto":
            return self.config
        recorded = _recorded_config(run_dir) if run_dir is not None else None
        if recorded is not None and recorded.job_key() == self.config.job_key():
            precision = recorded.precision
        else:
            size = input_size(self.config.transform)
            precision = resolve_precision("auto", self.config.device, size)
        return self.config.model_copy(update={"precision": precision})

    def bind(self, run_id: str, run_dir: Path) -> RunConfig:
        config = self.decided(run_dir)
        return config.model_copy(update={"run_dir": run_dir, "mlflow_run_id": run_id})


def _recorded_config(run_dir: Path) -> RunConfig | None:
    """The config a run folder was started with, None when it has none (or an unreadable one)."""
    try:
        return RunConfig.load(run_dir / CONFIG)
    except (OSError, ValueError):
        return None


def train(
    model: Path,
    train_data: Path,
    val_data: Path,
    out: Path,
    params: TrainParams | Mapping[str, Any],
    *,
    transform: TransformSpec | Mapping[str, Any] | Path | None = None,
    settings: Settings | None = None,
    data_version: dict[str, str] | None = None,
    run_name: str | None = None,
    run_id: str | None = None,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_timeout_s: int = RDZV_TIMEOUT_S,
    max_restarts: int = 1,
    timeout_s: float | None = None,
    tuning: TrialHook | None = None,
    env: Mapping[str, str] | None = None,
) -> TrainResult:
    """Train the untrained ``model`` on ``train_data``, validating on ``val_data``; write ``out``.

    ``out`` receives the ModelDirectory of the epoch with the best validation top-1. The MLflow run
    gets the parameters, per-epoch metrics, the training curves and every rank's log; its folder
    ``settings.runs_dir/<run id>`` keeps config, checkpoint and logs. ``transform``: the image
    transformation spec (or the TransformationDirectory holding it); None: the one the data was
    prepared with by Apply Image Transformation, else Init Image Transformation's defaults. The
    training set goes through its training mode, the validation set through its inference mode,
    and the ModelDirectory stores it for scoring.

    Which run: ``run_id`` when given (resume after a crash from its last checkpoint, or one node
    of a multi-node job). Otherwise (one node only) :func:`open_run` picks it: an unfinished run
    of this very request (same model, data, parameters, transform and ``out``) whose folder holds
    a checkpoint is continued, so a Prefect retry or a re-run of a crashed request trains only
    the epochs it lacks; else a new run, named ``run_name``, is created.

    Multi-node (``params.nodes`` > 1): call this once per node, each with its ``node_rank`` (0 to
    nodes - 1), the same ``run_id`` (from :func:`open_run`) and the same ``rdzv_endpoint``
    (host:port of a machine every node reaches); the torchruns meet there by c10d rendezvous and
    wait at most ``rdzv_timeout_s`` for each other. The run folder and ``out`` must be on storage
    every node shares. Node 0's agent owns the run: it sets its status and attaches the logs;
    global rank 0, wherever it lands, alone logs metrics and writes the model.

    torchrun restarts crashed workers up to ``max_restarts`` times, resuming from the checkpoint;
    ``timeout_s`` bounds the whole run. ``tuning``: set for a trial of a tuning study
    (:mod:`tasks.tune`): rank 0 reports the metric to the study after every epoch and the run
    ends early, with ``pruned`` set, when the study's pruner says so. ``env``: more environment
    for torchrun and its workers (a trial's ``CUDA_VISIBLE_DEVICES``: the GPUs lent to it).

    Raises the seed's InvalidModelDirectoryError, NotLabeledDatasetError, InvalidDatasetError,
    InvalidTransformationDirectoryError, InvalidParameterError before anything starts;
    RendezvousTimeoutError when not every node came; a worker's ImageOpsError as itself; any other
    failure as TrainingFailedError naming the log folder.
    """
    settings = settings or get_settings()
    log = step_logger(__name__)  # inside a Prefect run, these lines reach the UI
    params = _checked_params(params)
    _check_launch(params, run_id, node_rank, rdzv_endpoint, rdzv_timeout_s, max_restarts)
    request = _check_request(
        model, train_data, val_data, out, params, transform, settings, data_version
    )
    experiment_id = configure_mlflow(settings)
    client = MlflowClient(settings.tracking_uri, settings.registry_uri)
    if run_id is None:
        run_id = _open_run(client, experiment_id, request, settings, run_name)
    else:
        _require_run(client, run_id)
    run_dir = settings.runs_dir / run_id
    config = request.bind(run_id, run_dir)
    if tuning is not None:
        config = config.model_copy(update={"tuning": tuning})
    lead = node_rank == 0
    log.info(
        "MLflow run %s, run folder %s (node %d of %d)", run_id, run_dir, node_rank, params.nodes
    )
    torchrun_log = run_dir / (
        TORCHRUN_LOG if params.nodes == 1 else f"torchrun_node_{node_rank}.log"
    )
    with _launch_lock(run_dir, run_id) if lead else contextlib.nullcontext():
        if lead:
            client.update_run(run_id, status="RUNNING")
        status = "FAILED"
        result: dict[str, Any] | None = None
        try:
            config_path = _write_config(run_dir, config)
            command = _torchrun_command(
                params, config_path, run_id, rdzv_endpoint, max_restarts, rdzv_timeout_s
            )
            env = {
                **os.environ,
                **settings.environment(),
                "MLFLOW_RUN_ID": run_id,
                "PYTHONUNBUFFERED": "1",  # stream the workers' lines as they come
                # By default the workers share the agent's store across restarts, and a
                # restarted rank 0 can read the killed rank's stale gloo address from it and
                # fail to connect ("Connection refused"); a store per attempt has no stale keys.
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                # Workers import `tasks` by module name, whatever the working folder.
                "PYTHONPATH": os.pathsep.join(
                    p for p in (_source_root(), os.environ.get("PYTHONPATH", "")) if p
                ),
                **(env or {}),
            }
            offset = torchrun_log.stat().st_size if torchrun_log.is_file() else 0
            started = time.time()
            if params.nodes > 1:
                _mark_node(run_dir, node_rank, started)
            try:
                returncode = _run_torchrun(
                    command, env, run_dir, timeout_s, log_name=torchrun_log.name
                )
            finally:
                if params.nodes > 1:
                    _mark_node(run_dir, node_rank, started, ended=time.time())
            if returncode != 0:
                output = _read_from(torchrun_log, offset)
                if RDZV_TIMEOUT_MARK in output:
                    raise _rendezvous_timeout(
                        run_dir, run_id, params, node_rank, rdzv_endpoint, rdzv_timeout_s, started
                    )
                raise _failure(run_dir, returncode, torchrun_log, output)
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
            if lead:
                _complete_run(client, run_id, run_dir, result, status)
    log.info("training finished: %s", result["metrics"])
    if lead:
        _publish_report(run_id, run_dir, result, settings)
    return _as_result(result, out, run_id, run_dir)


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


def finished_result(run_id: str, out: Path, settings: Settings | None = None) -> TrainResult:
    """A finished job's result, read from the run folder, as the node agent that ran it returns it.

    For node agents that ran elsewhere (flow runs on a work pool): the run folder is on the
    shared storage every node writes to.
    """
    run_dir = (settings or get_settings()).runs_dir / run_id
    path = run_dir / RESULT
    if not path.is_file():
        raise TrainingFailedError(
            f"Run {run_id} has no {RESULT} in {run_dir}: its rank 0 did not finish here.",
            "Multi-node runs need IMAGEOPS_HOME (the run folders) on storage every node shares.",
        )
    return _as_result(json.loads(path.read_text()), out, run_id, run_dir)


train_task = step(train, name="train")


def open_run(
    model: Path,
    train_data: Path,
    val_data: Path,
    out: Path,
    params: TrainParams | Mapping[str, Any],
    *,
    transform: TransformSpec | Mapping[str, Any] | Path | None = None,
    settings: Settings | None = None,
    data_version: dict[str, str] | None = None,
    run_name: str | None = None,
) -> str:
    """Check the training request in full and return the id of the MLflow run to train it in.

    An unfinished run (RUNNING, FAILED or KILLED) of the same request whose run folder holds a
    checkpoint, and that no launcher is training right now, is continued: a retry then resumes
    instead of starting over. A FINISHED run is never reused: asking again for a trained model
    trains a new one. Otherwise a new run is created, with its parameters logged. A multi-node
    job opens its run once with this and hands the id to every node's :func:`train`.

    Raises what :func:`train` raises before it starts.
    """
    settings = settings or get_settings()
    params = _checked_params(params)
    request = _check_request(
        model, train_data, val_data, out, params, transform, settings, data_version
    )
    experiment_id = configure_mlflow(settings)
    client = MlflowClient(settings.tracking_uri, settings.registry_uri)
    return _open_run(client, experiment_id, request, settings, run_name)


open_run_task = step(open_run, name="open-training-run")


def local_rendezvous_endpoint() -> str:
    """``127.0.0.1:<a port free now>``: the rendezvous of node agents that all run here.

    Agents on other machines cannot reach a loopback address, so no stranger joins the job by
    chance (torch's store itself listens on the port on every interface: the port is free only
    for a moment before torchrun takes it). Real multi-node jobs name a host all machines reach.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def _checked_params(params: TrainParams | Mapping[str, Any]) -> TrainParams:
    values = params.model_dump() if isinstance(params, TrainParams) else dict(params)
    return TrainParams.checked(**values)  # also catches model_construct()ed or dict params


def _check_launch(
    params: TrainParams,
    run_id: str | None,
    node_rank: int,
    rdzv_endpoint: str | None,
    rdzv_timeout_s: int,
    max_restarts: int,
) -> None:
    """The launch options, refused before anything starts when they cannot make a job."""
    if max_restarts < 0:
        raise InvalidParameterError(f"max_restarts = {max_restarts}, expected an integer >= 0.")
    if not 0 <= node_rank < params.nodes:
        raise InvalidParameterError(
            f"node_rank = {node_rank}, expected 0 to {params.nodes - 1} (nodes = {params.nodes}).",
            "Give each node agent its own rank, 0 for the one that owns the MLflow run.",
        )
    if rdzv_timeout_s <= 0:
        raise InvalidParameterError(f"rdzv_timeout_s = {rdzv_timeout_s}, expected seconds > 0.")
    if params.nodes == 1:
        return
    if not rdzv_endpoint:
        raise InvalidParameterError(
            f"nodes = {params.nodes} needs a rendezvous endpoint; none was given.",
            "Pass rdzv_endpoint='host:port' of a machine every node reaches, the same on every "
            "node.",
        )
    host, _, port = rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidParameterError(
            f"rdzv_endpoint = {rdzv_endpoint!r}, expected host:port (port 1 to 65535).",
            "For example 10.0.0.5:29400, the same on every node.",
        )
    if run_id is None:
        raise InvalidParameterError(
            f"nodes = {params.nodes}: every node agent needs the id of the job's MLflow run.",
            "Open the run once with `imageops train ... --open-run` (the train flow does it "
            "itself) and pass its id to every node agent with --run-id.",
        )


def _check_request(
    model: Path,
    train_data: Path,
    val_data: Path,
    out: Path,
    params: TrainParams,
    transform: TransformSpec | Mapping[str, Any] | Path | None,
    settings: Settings,
    data_version: dict[str, str] | None,
) -> _Request:
    """Everything the seed refuses, refused; the run configuration resolved (not yet bound)."""
    spec = read_untrained(Path(model))
    train_manifest, val_manifest = _check_datasets(Path(train_data), Path(val_data))
    check_destination(Path(out), replaces=MODEL_JSON)  # before torchrun, not after the epochs
    spec_transform = _check_transform(
        transform,
        {
            "train": (Path(train_data), train_manifest.transform),
            "val": (Path(val_data), val_manifest.transform),
        },
    )
    _check_sizes(params, train_manifest)
    device = _resolve_device(params)
    # Refused here, before a run exists: fp16 on CPU, bf16 where the device cannot train in it.
    # "auto" is decided later, once per run (_Request.decided): a resume keeps what it recorded.
    precision = (
        resolve_precision(params.precision, device, input_size(spec_transform))
        if params.precision != "auto"
        else "fp32"  # a placeholder, outside the job's identity (RunConfig.job_key)
    )
    if spec.pretrained:
        _ensure_pretrained_weights(spec, settings)
    config = RunConfig(
        params=params,
        architecture=spec,
        classes=train_manifest.classes,
        transform=spec_transform,
        train_data=Path(train_data).resolve(),
        val_data=Path(val_data).resolve(),
        data_fingerprint={
            "train": manifest_fingerprint(train_data),
            "val": manifest_fingerprint(val_data),
        },
        data_version=data_version or {},
        out=Path(out).resolve(),
        run_dir=settings.runs_dir,
        mlflow_run_id=None,
        device=device,
        precision=precision,
        world_size=params.world_size,
    )
    return _Request(spec, config, train_manifest, val_manifest)


def _check_datasets(train_data: Path, val_data: Path) -> tuple[Manifest, Manifest]:
    train_manifest = read_manifest(train_data)
    require_labeled(train_manifest, "training", train_data)
    val_manifest = read_manifest(val_data)
    require_labeled(val_manifest, "validation", val_data)
    require_same_classes(train_manifest, val_manifest)
    if len(train_manifest.classes) < 2:  # one class: nothing to learn, top-1 is 1.0 from the start
        raise InvalidDatasetError(
            f"The training dataset {train_data} has only the classes {train_manifest.classes}; "
            "a classifier needs two or more.",
            "Add a class folder for each other category, then convert and split again.",
        )
    if not val_manifest.images:
        raise InvalidDatasetError(
            f"The validation dataset {val_data} has no images.",
            "Split with a fraction below 1 so the second half keeps some images.",
        )
    return train_manifest, val_manifest


def _check_transform(
    transform: TransformSpec | Mapping[str, Any] | Path | None,
    data: Mapping[str, tuple[Path, AppliedTransform | None]],
) -> TransformSpec:
    """The run's spec, checked in full against what the data was prepared with.

    The one given (read from a TransformationDirectory when a path is given); else the one Apply
    Image Transformation prepared the data with; else Init Image Transformation's defaults.
    Data prepared with another spec is refused, never resized again.
    """
    if transform is None:
        spec = data_transform(data) or TransformSpec()
    elif isinstance(transform, str | Path):
        spec = read_transformation(Path(transform))
    else:
        values = transform.model_dump() if isinstance(transform, TransformSpec) else transform
        spec = transform_spec(**values)
    input_size(spec)  # training and scoring must feed the network one size
    for role, (root, applied) in data.items():
        check_applied(spec, applied, root, "training" if role == "train" else "inference")
    return spec


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


def _require_run(client: MlflowClient, run_id: str) -> None:
    try:
        client.get_run(run_id)
    except MlflowException as exc:
        if transient(exc):  # MLflow is down, not the run: a retry may get through
            raise
        raise InvalidParameterError(
            f"run_id = {run_id!r}: no such MLflow run.",
            "Leave run_id empty to start a new run.",
        ) from exc


def _open_run(
    client: MlflowClient,
    experiment_id: str,
    request: _Request,
    settings: Settings,
    run_name: str | None,
) -> str:
    """The unfinished run of this request to continue, else a new run (parameters logged)."""
    key = request.config.job_key()
    resumable = _resumable_run(client, experiment_id, key, settings.runs_dir)
    if resumable is not None:
        step_logger(__name__).info(
            "continuing unfinished MLflow run %s of the same request from its checkpoint",
            resumable,
        )
        return resumable
    config = request.decided()
    tags = _tags(request.spec, config.params, config.device, config.data_version)
    # The data md5s above and the code's revision: together they say what this run learned from.
    tags["imageops.git_revision"] = git_revision(settings.project_root)
    run_id = client.create_run(
        experiment_id,
        run_name=run_name or _default_run_name(request.spec, config.params),
        tags={**tags, RESUME_KEY_TAG: key},
    ).info.run_id
    # Once, here: a run that fails in its workers still shows what it was asked to do.
    _log_params(client, run_id, config, request.train_manifest, request.val_manifest)
    return run_id


def _resumable_run(
    client: MlflowClient, experiment_id: str, key: str, runs_dir: Path
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
        run_dir = runs_dir / run.info.run_id
        if run.info.status not in UNFINISHED or not (run_dir / CHECKPOINT).is_file():
            continue
        if not _in_training(run_dir):
            return run.info.run_id
    return None


@contextlib.contextmanager
def _launch_lock(run_dir: Path, run_id: str) -> Iterator[None]:
    """Hold the run's lock while node 0's launcher trains it; refuse if another holds it.

    Two launches of one run at once would train into one checkpoint and one model. The lock
    (``flock``, released by the kernel whatever way the holder dies) also tells a run that is
    merely unfinished, and may be continued, from one that is being trained right now.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LAUNCH_LOCK, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InvalidParameterError(
                f"MLflow run {run_id} is being trained right now by another launcher.",
                "Wait for it to end, or start a new run (leave run_id empty).",
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _in_training(run_dir: Path) -> bool:
    """True while some launcher holds ``run_dir``'s lock."""
    path = run_dir / LAUNCH_LOCK
    if not path.is_file():
        return False
    with open(path, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
    return False


def _mark_node(run_dir: Path, node_rank: int, started: float, ended: float | None = None) -> None:
    """Note in the shared run folder when this node's torchrun ran: who came to a rendezvous.

    torch's rendezvous timeout says only that it timed out; these notes let the error say which
    nodes came and which did not.
    """
    write_json(
        run_dir / NODES / f"node_{node_rank}.json",
        {
            "node_rank": node_rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": started,
            "ended": ended,
        },
    )


def _arrived_nodes(run_dir: Path, nodes: int, started: float, timeout_s: int) -> set[int]:
    """Node ranks whose torchrun was up while this node's waited (``started`` on).

    A node that came earlier and was still waiting started at most ``timeout_s`` before us; a
    note of an earlier attempt ended before we started. A second of slack covers clock skew.
    """
    arrived = set()
    for path in (run_dir / NODES).glob("node_*.json"):
        try:
            note = json.loads(path.read_text())
            rank, began, ended = int(note["node_rank"]), float(note["started"]), note["ended"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        recent = began >= started - timeout_s - CLOCK_SLACK_S
        overlapping = ended is None or float(ended) >= started - CLOCK_SLACK_S
        if 0 <= rank < nodes and recent and overlapping:
            arrived.add(rank)
    return arrived


def _rendezvous_timeout(
    run_dir: Path,
    run_id: str,
    params: TrainParams,
    node_rank: int,
    endpoint: str | None,
    timeout_s: int,
    started: float,
) -> RendezvousTimeoutError:
    arrived = _arrived_nodes(run_dir, params.nodes, started, timeout_s) | {node_rank}
    missing = [rank for rank in range(params.nodes) if rank not in arrived]
    return RendezvousTimeoutError(
        f"The rendezvous of training run {run_id} at {endpoint} timed out after {timeout_s} s: "
        f"{len(arrived)} of {params.nodes} nodes arrived (node rank "
        f"{', '.join(map(str, sorted(arrived)))}; missing: {', '.join(map(str, missing))}).",
        f"Start the agent of every node within {timeout_s} s of the others, each with its "
        f"own node rank, nodes = {params.nodes}, run id {run_id} and rendezvous endpoint "
        f"{endpoint}; check that every node reaches {endpoint}; or allow more time with "
        "rdzv_timeout_s (--rdzv-timeout).",
    )


def _read_from(path: Path, offset: int) -> str:
    """The text of ``path`` from byte ``offset`` on: this launch's part of an appended log."""
    if not path.is_file():
        return ""
    with open(path, "rb") as handle:
        handle.seek(offset)
        return handle.read().decode("utf-8", errors="replace")


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
        "memory_efficient": config.architecture.memory_efficient,
        "zero_init_residual": config.architecture.zero_init_residual,
        "world_size": config.world_size,
        "effective_learning_rate": config.params.learning_rate * config.world_size,
        "device": config.device,
        "resolved_precision": config.precision,
        "num_classes": len(config.classes),
        "train_images": len(train_manifest.images),
        "val_images": len(val_manifest.images),
        "input_size": input_size(config.transform),
        **{f"transform.{k}": v for k, v in config.transform.model_dump().items()},
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
    rdzv_timeout_s: int = RDZV_TIMEOUT_S,
) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run"]
    if params.nodes == 1:
        command += ["--standalone", "--nnodes", "1"]
    else:
        # Every node runs this same command; c10d rendezvous at the endpoint assigns the ranks
        # (global rank 0 may land on any node: every side effect keys on it, not on node 0).
        command += [
            "--nnodes",
            str(params.nodes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            str(rdzv_endpoint),
            "--rdzv-id",
            run_id,
            "--rdzv-conf",
            f"join_timeout={rdzv_timeout_s}",
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
    """Copy torchrun's output to the console and to its log in the run folder, line by line.

    A worker's traceback may quote a settings URI (MLflow's errors do): passwords are masked.
    Tracebacks go to the log only: the console keeps the error line and says where the rest is,
    as the CLI does for every error (the named error that ends the run says what to do).
    """
    in_traceback = False
    with open(path, "a", encoding="utf-8") as sink:
        for raw in stream:
            line = redact_uri(raw)
            sink.write(line)
            sink.flush()
            at = line.find("Traceback (most recent call last):")  # torchrun's report indents it
            if at >= 0:
                in_traceback, line = True, f"{line[:at]}(traceback in {path})\n"
            elif in_traceback and (line[:1] in (" ", "\t") or not line.strip()):
                continue  # a frame of the traceback
            else:
                in_traceback = False  # the exception's own line ends it, and is shown
            sys.stdout.write(line)
            sys.stdout.flush()


def _run_torchrun(
    command: list[str],
    env: dict[str, str],
    run_dir: Path,
    timeout_s: float | None,
    *,
    log_name: str = TORCHRUN_LOG,
) -> int:
    step_logger(__name__).info("starting: %s", " ".join(command))
    proc = subprocess.Popen(
        # SIGKILLed with this process; its workers die with it (tasks.train.worker's main).
        dying_with_this_process(command),
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
    pump = threading.Thread(target=_pump, args=(proc.stdout, run_dir / log_name), daemon=True)
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


def _failure(run_dir: Path, returncode: int, torchrun_log: Path, output: str = "") -> ImageOpsError:
    """The error to raise for a failed torchrun: the worker's own error class when it had one.

    ``output`` is what this launch's torchrun printed (its log holds earlier launches too).
    """
    if RDZV_CONNECTION_MARK in output:
        return TrainingFailedError(
            f"torchrun could not reach the rendezvous of run {run_dir.name}. Last lines of "
            f"{torchrun_log}:\n{tail(torchrun_log)}",
            "Check the rendezvous endpoint (host:port of a machine every node reaches, open in "
            "its firewall) and start the agent on that host first.",
        )
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
            where = torchrun_log
    return TrainingFailedError(
        f"Training failed: {what}. Last lines of {where}:\n{tail(where)}",
        f"Every rank's log is in {run_dir} (rank_0.log is the master's).",
    )


def _publish_report(run_id: str, run_dir: Path, result: dict[str, Any], settings: Settings) -> None:
    """The training curves, per-epoch metrics and where each rank's log is, as an artifact."""
    rows = [{"epoch": int(h.pop("epoch")), **h} for h in map(dict, result.get("history", []))]
    logs_page = run_url(settings, run_id, "artifacts")
    logs = "\n".join(
        f"- `{path.name}`: `{path}`"
        for path in [*sorted(run_dir.glob("rank_*.log")), *sorted(run_dir.glob("torchrun*.log"))]
    )
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
    publish_markdown("training-report", markdown, f"Training curves of MLflow run {run_id}")


def _complete_run(
    client: MlflowClient,
    run_id: str,
    run_dir: Path,
    result: dict[str, Any] | None,
    status: str,
) -> None:
    """Write the run's last records to MLflow and end it with ``status``, outlasting an outage.

    Rank 0 gives up on a record quickly when MLflow does not answer (the training must not wait
    on it; :mod:`tasks.train.tracker`); here the training is over and the launcher can wait. A
    trained run gets every epoch's metrics it still lacks (from the result's history, each step
    once), the best epoch's, the curves and every rank's log, then FINISHED. Each call that fails
    for a reason that may pass (server down, restarting, 5xx) is tried again every
    TRACKING_PAUSE_S for TRACKING_PATIENCE_S (10 minutes, on top of the MLflow client's own
    retries, MLFLOW_HTTP_REQUEST_*): an MLflow server that is down for up to 10 minutes when
    training ends loses nothing. If it is down longer, the run, still RUNNING, is an error worth
    a retry: the retry resumes this run, finds every epoch trained and completes the record.

    A run that failed or was stopped gets one try of each: its own error is what counts, and a
    retry attaches the logs again.
    """
    patience = TRACKING_PATIENCE_S if status == "FINISHED" else 0.0
    deadline = time.monotonic() + patience
    if result is not None:
        best = {
            "epoch": float(result["epochs_trained"]),
            "best/val/top1": result["metrics"][TOP1],
            "best/epoch": float(result["best_epoch"]),
        }
        history = [*result["history"], best]
        _patiently(lambda: log_missing(client, run_id, history), "the metrics", deadline)
        if (run_dir / CURVES).is_file():
            curves = str(run_dir / CURVES)
            _patiently(lambda: client.log_artifact(run_id, curves), CURVES, deadline)
    # One torchrun log per node agent (torchrun.log, or torchrun_node_<k>.log on many nodes).
    logs = [*sorted(run_dir.glob("rank_*.log")), *sorted(run_dir.glob("torchrun*.log"))]
    for path in [*logs, run_dir / CONFIG]:
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
    waited_since = None
    while True:
        try:
            call()
        except Exception as exc:
            reason = redact_uri(str(exc))  # MLflow's errors quote the tracking URI
            if not transient(exc) or time.monotonic() >= deadline:
                log.warning("MLflow did not take %s; giving up: %s", what, reason)
                return False
            if waited_since is None:
                waited_since = time.monotonic()
                log.warning(
                    "MLflow did not take %s; trying again every %g s for up to %.0f s: %s",
                    what,
                    TRACKING_PAUSE_S,
                    deadline - waited_since,
                    reason,
                )
            time.sleep(TRACKING_PAUSE_S)
            continue
        if waited_since is not None:
            log.info("MLflow took %s after %.0f s", what, time.monotonic() - waited_since)
        return True
