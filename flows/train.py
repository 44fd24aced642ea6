"""The train flow: one training job, by torchrun on this machine or on a Ray cluster.

Composition only. The request says where it runs (``params.cluster``); the train task runs it
there: on a cluster the job is one gang of ``params.nodes`` nodes (tasks.train.cluster), placed,
restarted and cancelled by the cluster, not by Prefect.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import to_json

from flows.config import (
    DEMO_MODEL,
    DEMO_TRAIN,
    DEMO_TRANSFORM,
    MODEL_FIELD,
    TRAIN_FIELD,
    DemoModel,
    DemoTrainParams,
    DemoTransform,
)
from models.untrained import read_untrained
from tasks.data.data_refs import REF_SYNTAX, ResolvedData, resolve_data
from tasks.data.versioning import version_task
from tasks.inference.export import export_task
from tasks.registry.promote import CHALLENGER
from tasks.registry.register import register_task
from tasks.shared.artifacts import TRAINING_REPORT, republish
from tasks.shared.flow_parameters import checked_flow
from tasks.shared.forms import form_field
from tasks.shared.settings import get_settings
from tasks.shared.step import name_flow_run, named_from_parameters
from tasks.train.build_model import build_model_task
from tasks.train.launch import TrainResult, train_task, training_run_name
from tasks.train.outputs_folder import outputs_folder
from tasks.train.request import TrainRequest


def training_name(parameters: dict[str, Any]) -> str:
    """The training sub-run's name from its request, before its first log line:
    ``training-resnet18-5-epochs`` (tasks.train.launch gives the same once it has checked it)."""
    request = TrainRequest.model_validate(parameters["request"])
    return training_run_name(read_untrained(request.model).arch, request.params.epochs)


@checked_flow(
    name="imageops-train", log_prints=True, flow_run_name=named_from_parameters(training_name)
)
def train_flow(request: TrainRequest) -> TrainResult:
    """Train ``request`` with ``params.nodes`` x ``params.nproc_per_node`` processes; the run is
    named after what it trains, and logs its epochs as they end (tasks.train.watch)."""
    return train_task(request, watched=True)


def train_and_report(request: TrainRequest) -> TrainResult:
    """:func:`train_flow` as a sub-flow, its training report shown on the calling run too (the
    run a person started from a deployment, where they look first).

    The result is the call's own return value. Results are not persisted (tasks.shared.step), so
    a state read back from the API has none: and when a busy database makes Prefect's client
    propose the final state twice, the second proposal is rejected and the call's state *is* the
    API's copy (``state.result()`` raised MissingResult after a finished training).
    """
    trained = train_flow(request)
    republish((TRAINING_REPORT,))
    return trained


def versioned(data: dict[str, ResolvedData], version: bool) -> dict[str, ResolvedData]:
    """``data`` with each local data set versioned (dvc add + push) when ``version`` is on.

    A data set fetched by version is that version already: it is recorded, not versioned again.
    """
    if not version:
        return data
    return {part: d if d.md5 else replace(d, md5=version_task(d.path)) for part, d in data.items()}


def data_refs(data: dict[str, ResolvedData]) -> dict[str, str]:
    """``part -> name@md5`` of the data sets that have both: what fetches them again anywhere."""
    return {part: d.ref for part, d in data.items() if d.ref}


class TrainedModel(BaseModel):
    """What a run of the train deployment produced."""

    model_dir: Path
    mlflow_run_id: str
    metrics: dict[str, float]
    data_version: dict[str, str]
    data_refs: dict[str, str] = {}  # part -> name@md5: the same data, from any machine
    registered_version: str | None  # None when not registered


class TrainSteps(BaseModel):
    """The train deployment's steps before and after training, each one a switch."""

    model_config = ConfigDict(extra="forbid")  # a misspelt switch is an error, not a no-op

    version_data: bool = Field(
        default=True,
        title="Version data with DVC",
        description="dvc add + push both data sets first; their md5s tag the run and model.",
    )
    register_model: bool = Field(
        default=True, title="Register", description="Export to ONNX and register as @challenger."
    )


EVERY_STEP = TrainSteps()


@checked_flow(name="imageops-train-model", log_prints=True)
def train_model_flow(
    model: Annotated[DemoModel, MODEL_FIELD] = DEMO_MODEL,
    train_data: Annotated[
        str,
        form_field(
            title="Training data",
            description="Labeled ImageDirectory: a path from the project root, or a data set "
            f"version as {REF_SYNTAX}, e.g. digits/train@latest, fetched from the DVC remote by "
            "whichever machine runs it. A path under data/ that this machine lacks is its "
            "data set's latest version.",
            min_length=1,
        ),
    ] = "data/digits/train",
    val_data: Annotated[
        str,
        form_field(
            title="Validation data",
            description="Labeled ImageDirectory scored after every epoch (the best epoch wins): "
            "a path or a data set version as NAME@VERSION (digits/val@latest).",
            min_length=1,
        ),
    ] = "data/digits/val",
    params: Annotated[DemoTrainParams, TRAIN_FIELD] = DEMO_TRAIN,
    transform: Annotated[
        DemoTransform,
        form_field(
            title="Image transformation",
            description="Init Image Transformation; the default fits the 32x32 digits demo. "
            "Data prepared with another transform (Apply Image Transformation) is refused.",
        ),
    ] = DEMO_TRANSFORM,
    data_transform: Annotated[
        bool,
        form_field(
            title="Train with the data's own transform",
            description="On: the transform the data was prepared with (Apply Image "
            "Transformation), else Init Image Transformation's defaults (224 px); Image "
            "transformation above is then not used.",
        ),
    ] = False,
    steps: Annotated[
        TrainSteps,
        form_field(
            title="Steps around training",
            description="Version the data with DVC first; export and register the model after.",
        ),
    ] = EVERY_STEP,
) -> TrainedModel:
    """Train one model from the UI or a schedule: build, train (DDP), export, register."""
    settings = get_settings()
    chosen = None if data_transform else transform
    data = {
        "train": resolve_data(train_data, "training data", settings),
        "val": resolve_data(val_data, "validation data", settings),
    }
    train_path, val_path = data["train"].path, data["val"].path
    name_flow_run(f"train-{model.name}")
    data = versioned(data, steps.version_data)
    data_version = {part: d.md5 for part, d in data.items() if d.md5}
    if "train" in data_version:
        name_flow_run(f"train-{model.name}-data-{data_version['train'][:8]}")
    fresh = datetime.now(UTC).strftime("train-%Y%m%d-%H%M%S")
    asked = {
        "model": model, "train_data": train_path, "val_data": val_path, "params": params,
        "transform": chosen, "steps": steps, "data_version": data_version,
    }  # fmt: skip
    # The same request again after a stop: the same outputs, so the training resumes.
    with outputs_folder(settings, fresh, to_json(asked).decode()) as out:
        request = TrainRequest(
            model=out / "untrained", train_data=train_path, val_data=val_path,
            out=out / "model", params=params, transform=chosen, data_version=data_version,
        )  # fmt: skip
        build_model_task(model, request.model)
        trained = train_and_report(request)
        version = None
        if steps.register_model:
            export_task(trained.model_dir, sample=val_path)
            registered = register_task(
                trained.model_dir, data_version=data_version, alias=CHALLENGER,
                data_refs=data_refs(data), validation=val_path,
            )  # fmt: skip
            version = str(registered.version)
    return TrainedModel(
        model_dir=trained.model_dir,
        mlflow_run_id=trained.run_id,
        metrics=trained.metrics,
        data_version=data_version,
        data_refs=data_refs(data),
        registered_version=version,
    )
