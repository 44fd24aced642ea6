"""The training request, and its checks in full, before any process or MLflow run exists.

:class:`TrainRequest` is the request whole, built once where it comes in and passed whole; its
validators refuse bad values. :func:`check_request` reads the files and refuses everything else
the Azure design refuses, giving a :class:`Request` (the run configuration resolved). Apart from
the launch so that a reader finds every refusal in one place.
Details: docs/training.md#the-request-and-its-checks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from models.atomic import check_destination
from models.transform_spec import AppliedTransform, TransformSpec
from models.untrained import MODEL_JSON, ModelSpec, read_untrained
from tasks.data.imagedir import Manifest, read_manifest, require_labeled, require_same_classes
from tasks.data.transform import (
    check_applied,
    data_transform,
    input_size,
    read_transformation,
    transform_spec,
)
from tasks.shared.errors import InvalidDatasetError, InvalidParameterError
from tasks.shared.settings import Settings
from tasks.shared.step import step_logger
from tasks.shared.validation import checked
from tasks.train.params import RunConfig, TrainParams, TrialHook, manifest_fingerprint

CONFIG = "config.json"


@dataclass(frozen=True)
class Request:
    """A training request checked in full and resolved, before any MLflow run exists.

    ``config`` is not bound to a run yet (``run_dir`` is the runs folder, no run id): its
    :meth:`~tasks.train.params.RunConfig.job_key` is what finds an unfinished run to continue.
    """

    spec: ModelSpec
    config: RunConfig  # with ``precision`` still to decide when "auto" (see :meth:`decided`)
    train_manifest: Manifest
    val_manifest: Manifest
    # True once "auto" was decided where the job runs (a cluster node): config holds it.
    precision_decided: bool = False

    def decided(self, run_dir: Path | None = None) -> RunConfig:
        """The config with "auto" precision decided once per run, never again on a resume.

        A run folder that already holds this job's ``config.json`` (a retry, a restart on
        another machine) keeps the precision recorded there; else it is decided now, from what
        the device is (tasks.train.precision.precision_choice).
        """
        params = self.config.params
        if params.precision != "auto" or self.precision_decided:
            return self.config
        recorded = _recorded_config(run_dir) if run_dir is not None else None
        if recorded is not None and recorded.job_key() == self.config.job_key():
            precision = recorded.precision
        else:
            from tasks.train.precision import resolve_precision

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


class TrainRequest(BaseModel):
    """One training request, whole: what to train, and how this launch joins the job.

    Built once where a request comes in (the CLI, the flows' parameters, params.yaml, a tuning
    trial) and passed whole to the launch, the node agents and the deployments that run them
    (as its JSON). Its validators refuse, before anything starts, parameters out of range and
    launch options that cannot make a job; the data, the model and the device are checked by
    :func:`check_request`, where the files are read.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Path  # the UntrainedModelDirectory
    train_data: Path
    val_data: Path
    out: Path  # the ModelDirectory to write: the epoch with the best validation top-1
    params: TrainParams
    # The spec, or the TransformationDirectory holding it; None: the one the data was prepared
    # with (Apply Image Transformation), else Init Image Transformation's defaults.
    transform: TransformSpec | Path | None = None
    data_version: dict[str, str] = Field(default_factory=dict)  # DVC md5s: tags of the run
    run_name: str | None = None  # a new run's name
    # Which run: None opens one (an unfinished run of the same request is continued).
    run_id: str | None = None
    # Restarts of crashed workers (torchrun) or of a cluster job's gang, from the checkpoint.
    max_restarts: int = 1
    timeout_s: float | None = None  # bounds the whole run
    tuning: TrialHook | None = None  # set for a trial of a tuning study
    # More environment for torchrun and its workers (a trial's CUDA_VISIBLE_DEVICES).
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("params", mode="before")
    @classmethod
    def _checked_params(cls, params: Any) -> TrainParams:
        """Every value checked, however the parameters were built (a dict, model_construct())."""
        values = params.model_dump() if isinstance(params, TrainParams) else dict(params)
        return TrainParams.checked(**values)  # InvalidParameterError naming value and range

    @field_validator("transform", mode="before")
    @classmethod
    def _checked_transform(cls, transform: Any) -> Any:
        """A spec given as values: each checked, a bad one named with its range."""
        if isinstance(transform, Mapping):
            return transform_spec(**transform)  # InvalidParameterError
        return transform

    @model_validator(mode="after")
    def _launchable(self) -> TrainRequest:
        """Launch options that cannot make a job, refused before anything starts."""
        _check_launch(self)
        return self

    @classmethod
    def checked(cls, **values: Any) -> TrainRequest:
        """Validate ``values``; a bad one raises InvalidParameterError naming value and range."""
        return checked(cls, values, "training request")

    def under(self, root: Path) -> TrainRequest:
        """The request with its relative paths taken under ``root`` (the project root)."""
        paths = {k: root / v for k, v in self if isinstance(v, Path)}
        return self.model_copy(update=paths)


def _check_launch(request: TrainRequest) -> None:
    if request.max_restarts < 0:
        raise InvalidParameterError(
            f"max_restarts = {request.max_restarts}, expected an integer >= 0."
        )


def check_request(
    request: TrainRequest, settings: Settings, *, device: str | None = None
) -> Request:
    """Everything Azure refuses, refused; the run configuration resolved (not yet bound).

    ``device``: decided elsewhere (a cluster job's, from the cluster's resources); its
    precision is then decided on the cluster too (:mod:`tasks.train.cluster`).
    """
    spec = read_untrained(request.model)
    train_data, val_data, out = request.train_data, request.val_data, request.out
    train_manifest, val_manifest = _check_datasets(train_data, val_data)
    check_destination(out, replaces=MODEL_JSON)  # before torchrun, not after the epochs
    spec_transform = _check_transform(
        request.transform,
        {
            "train": (train_data, train_manifest.transform),
            "val": (val_data, val_manifest.transform),
        },
    )
    params = request.params  # RunConfig fills the fields it leaves empty from its recipe
    check_sizes(params, len(train_manifest.images))
    on_cluster = device is not None
    device = device or _resolve_device(params)
    from tasks.train.precision import resolve_precision  # imports torch

    # Refused here, before a run exists: fp16 on CPU, bf16 where the device cannot train in it.
    # "auto" is decided later, once per run (Request.decided): a resume keeps what it recorded.
    precision = (
        resolve_precision(params.precision, device, input_size(spec_transform))
        if params.precision != "auto" and not on_cluster
        else "fp32"  # a placeholder, outside the job's identity (RunConfig.job_key)
    )
    if not on_cluster:  # each node fetches into its own cache
        _check_network(spec, settings, spec_transform)
    config = RunConfig(
        params=params,
        architecture=spec,
        classes=train_manifest.classes,
        transform=spec_transform,
        train_data=train_data.resolve(),
        val_data=val_data.resolve(),
        data_fingerprint={
            "train": manifest_fingerprint(train_data),
            "val": manifest_fingerprint(val_data),
        },
        data_version=request.data_version,
        out=out.resolve(),
        run_dir=settings.runs_dir,
        mlflow_run_id=None,
        device=device,
        precision=precision,
        world_size=params.world_size,
    )
    return Request(spec, config, train_manifest, val_manifest)


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
    transform: TransformSpec | Path | None,
    data: Mapping[str, tuple[Path, AppliedTransform | None]],
) -> TransformSpec:
    """The run's spec, checked in full against what the data was prepared with.

    The one given (read from a TransformationDirectory when a path is given); else the one Apply
    Image Transformation prepared the data with; else Init Image Transformation's defaults.
    Data prepared with another spec is refused, never resized again.
    """
    if transform is None:
        spec = data_transform(data) or TransformSpec()
    elif isinstance(transform, Path):
        spec = read_transformation(transform)
    else:
        spec = transform
    input_size(spec)  # training and scoring must feed the network one size
    for role, (root, applied) in data.items():
        check_applied(spec, applied, root, "training" if role == "train" else "inference")
    return spec


def check_sizes(params: TrainParams, images: int, counted: str | None = None) -> None:
    """Refuse a batch, or a number of processes, that the training set cannot fill.

    ``images`` is the training set's size, or, before convert and split have made it, an upper
    bound on it (``imageops run``'s check, :meth:`flows.config.PipelineConfig.check_sources`):
    either way a request refused here would be refused at the training. ``counted`` says how a
    bound was counted (default: "<images> images").
    """
    size = counted or f"{images} images"
    if params.batch_size > images:
        raise InvalidParameterError(
            f"batch_size = {params.batch_size} is larger than the training set ({size}).",
            f"Use a batch size of at most {images}.",
        )
    if images <= params.world_size:
        # Each process needs 2 images or more: BatchNorm cannot train on a batch of one.
        raise InvalidParameterError(
            f"{params.world_size} processes (nodes x nproc_per_node) need more training images "
            f"than the training set has ({size}): each process trains on at least 2.",
            "Use fewer processes, or more training data.",
        )


def _resolve_device(params: TrainParams) -> str:
    import torch

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


def _check_network(spec: ModelSpec, settings: Settings, transform: TransformSpec) -> None:
    """Check the network here, before any run exists: an input size it cannot take, or missing
    pretrained weights, fail now (naming the size or the path) instead of as a traceback in every
    worker; weights not yet in the cache are fetched once, not per worker.
    """
    from models.pretrained import weights_cached  # imports torchvision
    from models.zoo import build_model, network_for, preprocessing

    size = input_size(transform)

    # Workers get TORCH_HOME = settings.torch_home, and torch.hub's cache is <TORCH_HOME>/hub.
    previous = os.environ.get("TORCH_HOME")
    os.environ["TORCH_HOME"] = str(settings.torch_home)
    try:
        network_for(spec).check(spec, size)
        if spec.pretrained and not weights_cached(spec):
            build_model(spec, num_classes=2, input_size=size)  # downloads, or names the path
        if spec.pretrained:
            expected = preprocessing(spec)
            if (tuple(transform.mean), tuple(transform.std)) != (expected.mean, expected.std):
                step_logger(__name__).warning(
                    "%s's pretrained weights expect mean %s and std %s; this transform "
                    "normalises with %s and %s. `imageops transform init DEST --like-model %s` "
                    "writes the weights' transform.",
                    spec.arch,
                    expected.mean,
                    expected.std,
                    transform.mean,
                    transform.std,
                    spec.arch,
                )
    finally:
        if previous is None:
            os.environ.pop("TORCH_HOME", None)
        else:
            os.environ["TORCH_HOME"] = previous
