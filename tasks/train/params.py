"""Train PyTorch Model parameters, and the resolved configuration a torchrun worker runs from.

:class:`TrainParams` is what a person sets: the seed's parameters with the seed's defaults and
ranges (the Prefect UI renders it as a form). :class:`RunConfig` is everything a worker needs,
resolved once by the launcher and saved as JSON in the run folder: a restarted worker trains exactly
the same job, and a checkpoint can tell whether it belongs to that job.
"""

from __future__ import annotations

import hashlib
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from models.atomic import write_json
from models.directory import Preprocessing
from models.zoo import ModelSpec
from tasks.errors import InvalidParameterError


class TrainParams(BaseModel):
    """The seed's Train PyTorch Model parameters (defaults and ranges from the seed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    epochs: int = Field(
        5, gt=0, title="Epochs", description="How many times the whole training set is iterated."
    )
    batch_size: int = Field(
        16,
        gt=0,
        title="Batch size",
        description="Images per batch in each process; the global batch is this x all processes.",
    )
    warmup_epochs: int = Field(
        0,
        ge=0,
        title="Warm-up epochs",
        description="Epochs over which the learning rate rises linearly to its full value, "
        "in case the initial rate is too large to start converging.",
    )
    learning_rate: float = Field(
        0.001,
        gt=0,
        allow_inf_nan=False,
        title="Learning rate",
        description="Initial SGD learning rate of one process; distributed runs use it x the "
        "number of processes, decayed polynomially to 0. Lower it if the loss becomes NaN.",
    )
    seed: int = Field(
        1,
        title="Random seed",
        description="Seeds initialisation, shuffling and augmentation: same seed, same data, "
        "same processes give the same model.",
    )
    patience: int = Field(
        3,
        gt=0,
        title="Patience",
        description="Stop early after this many epochs without a lower validation loss.",
    )
    print_frequency: int = Field(
        10,
        gt=0,
        title="Print frequency",
        description="Log the training loss every this many iterations of an epoch.",
    )
    nodes: int = Field(
        1, ge=1, title="Nodes", description="Machines taking part (more than 1 needs rendezvous)."
    )
    nproc_per_node: int = Field(
        1,
        ge=1,
        title="Processes per node",
        description="Training processes per machine; on GPU at most one per visible GPU.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        title="Device",
        description="auto: CUDA when a GPU is visible, else CPU (gloo).",
    )
    horizontal_flip: bool = Field(
        False,
        title="Random horizontal flip",
        description="Flip training images left-right at random (not for digits or text).",
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @classmethod
    def checked(cls, **values: Any) -> TrainParams:
        """Validate ``values``; a bad one raises InvalidParameterError naming value and range."""
        try:
            return cls(**values)
        except ValidationError as exc:
            errors = exc.errors()
            names = [str(err["loc"][0]) if err["loc"] else "?" for err in errors]
            fields = [cls.model_fields[n] for n in names if n in cls.model_fields]
            if len(fields) < len(names):
                hint = "Known parameters: " + ", ".join(cls.model_fields) + "."
            else:  # say what each bad parameter is for, as the form would
                hint = " ".join(f"{f.title}: {f.description}" for f in fields)
            raise InvalidParameterError(
                "Invalid training parameter: "
                + "; ".join(_describe(cls, err) for err in errors)
                + ".",
                hint,
            ) from exc


def _describe(cls: type[BaseModel], err: Any) -> str:
    name = str(err["loc"][0]) if err["loc"] else "?"
    value = err.get("input")
    field = cls.model_fields.get(name)
    if field is None:  # extra="forbid"
        return f"unknown parameter {name!r} (= {value!r})"
    return f"{name} = {value!r}, expected {_expected(field)} (default {field.default!r})"


def _expected(field: Any) -> str:
    """The field's range in words, read from its type and constraints (one source of truth)."""
    annotation = field.annotation
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(annotation))
    kind = {int: "an integer", float: "a finite number", bool: "true or false"}.get(
        annotation, str(annotation)
    )
    bounds = []
    for meta in field.metadata:
        if isinstance(meta, annotated_types.Gt):
            bounds.append(f"> {meta.gt}")
        elif isinstance(meta, annotated_types.Ge):
            bounds.append(f">= {meta.ge}")
    return " ".join([kind, *bounds])


class RunConfig(BaseModel):
    """Everything a worker needs, resolved by the launcher; saved as ``config.json``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = 1
    params: TrainParams
    architecture: ModelSpec
    classes: list[str]
    preprocessing: Preprocessing
    train_data: Path
    val_data: Path
    # sha256 of each manifest.json: a resumed run must see the very same data.
    data_fingerprint: dict[str, str]
    data_version: dict[str, str] = Field(default_factory=dict)
    out: Path
    run_dir: Path
    mlflow_run_id: str | None = None
    device: Literal["cpu", "cuda"]
    world_size: int = Field(ge=1)

    def digest(self) -> str:
        """Identity of the job: a checkpoint is only resumed by a job with the same digest."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()

    def save(self, path: Path) -> Path:
        return write_json(path, self.model_dump(mode="json"))

    @classmethod
    def load(cls, path: Path) -> RunConfig:
        return cls.model_validate_json(Path(path).read_bytes())


def manifest_fingerprint(root: Path) -> str:
    """sha256 of ``<root>/manifest.json``, which lists every image with its own sha256."""
    from tasks.imagedir import MANIFEST

    return hashlib.sha256((Path(root) / MANIFEST).read_bytes()).hexdigest()
