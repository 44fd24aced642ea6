"""What a study records and hands out: attribute names, a trial asked, the job, an outcome.

A trial's job and its asked values are JSON-able, so a trial can run as a flow run elsewhere;
its outcome is read back from the study's storage (:func:`outcome_of`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from optuna.trial import FrozenTrial, TrialState
from pydantic import BaseModel, Field

from models.transform_spec import TransformSpec
from tasks.tune.parameters import Value
from tasks.tune.spec import TuningSpec

# Study attributes.
IDENTITY = "imageops.identity"
IDENTITY_DIGEST = "imageops.identity_digest"
OWNER = "imageops.owner"
PARENT_RUN = "imageops.mlflow_parent_run_id"
REGISTERED = "imageops.registered"
# Trial attributes.
VALUES = "imageops.values"  # the values trained with (reverse_log undone)
RESUMES = "imageops.resumes"  # the number of the interrupted trial whose run this one continues
INTERRUPTED = "imageops.interrupted"
ERROR = "imageops.error"
RUN_ID = "imageops.mlflow_run_id"
MODEL_DIR = "imageops.model_dir"
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


class AskedTrial(BaseModel):
    """A trial the study handed out: its number and the values to train with."""

    number: int = Field(title="Trial number", description="The study's number for the trial.")
    values: dict[str, Value] = Field(
        title="Values", description="Each tuned parameter's value for this trial."
    )
    resumes: int | None = Field(
        None,
        title="Resumes trial",
        description="The interrupted trial whose run this one continues; empty: a new run.",
    )

    @property
    def folder_number(self) -> int:
        return self.number if self.resumes is None else self.resumes


class TrialJob(BaseModel):
    """Everything a trial needs besides its values; JSON-able, so a remote flow run takes it."""

    study_name: str = Field(title="Study name", description="The Optuna study's name.")
    storage: str | None = Field(
        title="Study storage",
        description="The study's journal file; empty: the settings' database.",
    )
    spec: TuningSpec = Field(title="Tuning spec", description="The study's spec.")
    train_data: Path = Field(title="Training data", description="Labeled ImageDirectory.")
    val_data: Path = Field(title="Validation data", description="Labeled ImageDirectory.")
    transform: TransformSpec = Field(
        title="Image transformation", description="The transform every trial trains with."
    )
    data_version: dict[str, str] = Field(
        default_factory=dict, title="Data versions", description="DVC md5s of the data sets."
    )
    parent_run_id: str = Field(
        title="Parent MLflow run", description="The study's run; each trial's run is its child."
    )
    folder: Path = Field(title="Study folder", description="Where each trial's folder goes.")

    def trial_folder(self, asked: AskedTrial) -> Path:
        return self.folder / f"trial_{asked.folder_number:04d}"


class TrialOutcome(BaseModel):
    """One trial as it stands in the study: a row of the trials table."""

    number: int
    state: str  # COMPLETE, PRUNED, FAIL, RUNNING, WAITING
    value: float | None
    values: dict[str, Value]
    duration_s: float | None
    run_id: str | None = None
    model_dir: Path | None = None
    error: str | None = None
    interrupted: bool = False


@dataclass(frozen=True)
class Tally:
    """How far the study is: finished trials (an interrupted one is not) and failures."""

    complete: int
    pruned: int
    failed: int
    last_error: str | None

    @property
    def finished(self) -> int:
        return self.complete + self.pruned + self.failed


def outcome_of(trial: FrozenTrial) -> TrialOutcome:
    duration = trial.duration.total_seconds() if trial.duration is not None else None
    attrs = trial.user_attrs
    model_dir = attrs.get(MODEL_DIR)
    return TrialOutcome(
        number=trial.number,
        state=trial.state.name,
        value=trial.value if trial.value is not None and math.isfinite(trial.value) else None,
        values=attrs.get(VALUES, {}),
        duration_s=duration,
        run_id=attrs.get(RUN_ID),
        model_dir=Path(model_dir) if model_dir else None,
        error=attrs.get(ERROR),
        interrupted=bool(attrs.get(INTERRUPTED, False)),
    )


def interrupted(trial: FrozenTrial) -> bool:
    """A trial a killed flow left running: failed, but counted neither finished nor failed."""
    return bool(trial.user_attrs.get(INTERRUPTED, False))
