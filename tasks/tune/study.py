"""A study: opened or continued in Optuna storage, asked for trials, counted, closed.

Only a study with the same search space, metric, training setup and data continues; finished trials
are never run again. A trial a killed flow left RUNNING is marked interrupted and its parameters
queued again, continuing its training run from its checkpoint; numbering continues.
Details: docs/tuning.md#studies-continuing-and-interrupted-trials.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import optuna
from mlflow import MlflowClient
from optuna.storages import BaseStorage
from optuna.trial import TrialState

from models.transform_spec import TransformSpec
from tasks.data.imagedir import read_manifest
from tasks.shared.errors import TuningFailedError
from tasks.shared.settings import Settings
from tasks.shared.step import step_logger
from tasks.train.params import manifest_fingerprint
from tasks.tune.parent_run import parent_run
from tasks.tune.records import (
    ERROR,
    FINISHED,
    REGISTERED,
    RESUMES,
    VALUES,
    AskedTrial,
    Tally,
    TrialJob,
    TrialOutcome,
    interrupted,
    outcome_of,
)
from tasks.tune.records import OWNER as OWNER  # where tests have found it
from tasks.tune.resume import check_identity, queue_grid, recover_interrupted, take_ownership
from tasks.tune.search import make_pruner, make_sampler, suggest
from tasks.tune.spec import TuningSpec
from tasks.tune.storage import (
    describe_storage,
    open_storage,
    quiet_optuna,
    storage_ref,
    study_dir,
)


class Study:
    """A study opened for one tune flow: ask trials, settle them, count, report."""

    def __init__(
        self,
        spec: TuningSpec,
        study: optuna.Study,
        storage: BaseStorage,
        job: TrialJob,
        settings: Settings,
    ) -> None:
        self.spec = spec
        self.optuna = study
        self.storage = storage
        self.job = job
        self.settings = settings
        self.name = job.study_name
        self.study_id = storage.get_study_id_from_name(self.name)

    # --- counting ------------------------------------------------------------------------

    def budget(self) -> int:
        """Trials to finish in all: max_trial_count, or the grid's size when smaller."""
        if self.spec.algorithm == "grid":
            return min(self.spec.max_trial_count, self.spec.grid_size())
        return self.spec.max_trial_count

    def outcomes(self) -> list[TrialOutcome]:
        return [outcome_of(t) for t in self.optuna.get_trials(deepcopy=False)]

    def tally(self) -> Tally:
        trials = self.optuna.get_trials(deepcopy=False, states=FINISHED)
        failed = [t for t in trials if t.state == TrialState.FAIL and not interrupted(t)]
        last = max(failed, key=lambda t: t.number, default=None)
        return Tally(
            complete=sum(t.state == TrialState.COMPLETE for t in trials),
            pruned=sum(t.state == TrialState.PRUNED for t in trials),
            failed=len(failed),
            last_error=(
                f"trial {last.number}: {last.user_attrs.get(ERROR, 'no error recorded')}"
                if last
                else None
            ),
        )

    def failed_out(self, tally: Tally | None = None) -> bool:
        return (tally or self.tally()).failed > self.spec.max_failed_trial_count

    def can_ask(self, running: int) -> bool:
        """Another trial may start: a free slot, budget left, failures within bounds."""
        tally = self.tally()
        return (
            running < self.spec.parallel_trial_count
            and tally.finished + running < self.budget()
            and not self.failed_out(tally)
        )

    # --- trials --------------------------------------------------------------------------

    def ask(self) -> AskedTrial:
        """A new trial (a queued one first: a grid point, an interrupted trial's parameters)."""
        trial = self.optuna.ask()
        internal = suggest(trial, self.spec)
        values = self.spec.training_values(internal)
        trial.set_user_attr(VALUES, values)
        resumes = trial.user_attrs.get(RESUMES)
        step_logger(__name__).info(
            "study %s: trial %d with %s%s",
            self.name,
            trial.number,
            values,
            f" (continues interrupted trial {resumes})" if resumes is not None else "",
        )
        return AskedTrial(number=trial.number, values=values, resumes=resumes)

    def settle(self, number: int, error: str | None) -> TrialOutcome:
        """After a trial's task ended: a trial it left RUNNING (it crashed) is marked FAIL."""
        trial_id = self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)
        if self.storage.get_trial(trial_id).state == TrialState.RUNNING:
            self.storage.set_trial_user_attr(
                trial_id, ERROR, error or "the trial's task ended without telling the study"
            )
            self.optuna.tell(number, state=TrialState.FAIL, skip_if_finished=True)
        outcome = outcome_of(self.storage.get_trial(trial_id))
        detail = ""
        if outcome.value is not None:
            detail = f" with {self.spec.metric} = {outcome.value:.4f}"
        elif outcome.error:
            detail = f": {outcome.error}"
        step_logger(__name__).info(
            "study %s: trial %d %s%s", self.name, number, outcome.state, detail
        )
        return outcome

    def best(self) -> TrialOutcome | None:
        """The best completed trial (pruned and failed ones have no value to compare)."""
        complete = self.optuna.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if not complete:
            return None
        return outcome_of(self.optuna.best_trial)

    def registered_version(self, best: TrialOutcome) -> int | None:
        """The registry version of ``best`` if a flow of this study registered it already."""
        record = self.optuna.user_attrs.get(REGISTERED) or {}
        return int(record["version"]) if record.get("trial") == best.number else None

    def record_registration(self, best: TrialOutcome, version: int) -> int:
        """Remember the registered best trial: a flow continuing a finished study skips it."""
        self.optuna.set_user_attr(REGISTERED, {"trial": best.number, "version": version})
        client = MlflowClient(self.settings.tracking_uri, self.settings.registry_uri)
        client.set_tag(self.job.parent_run_id, "tune.registered_version", str(version))
        return version

    def raise_if_failed(self) -> None:
        """TuningFailedError when too many trials failed or none completed."""
        tally = self.tally()
        where = f"Study {self.name!r} ({describe_storage(self.job.storage)})"
        if self.failed_out(tally):
            raise TuningFailedError(
                f"{where}: {tally.failed} trials failed, more than max_failed_trial_count = "
                f"{self.spec.max_failed_trial_count}. Last error: {tally.last_error}",
                "Fix the cause (e.g. a learning rate range so high that training diverges), or "
                "raise max_failed_trial_count; then start the flow again with the same study "
                "name to continue the study.",
            )
        if tally.complete == 0:
            raise TuningFailedError(
                f"{where}: no trial completed ({tally.pruned} pruned, {tally.failed} failed); "
                f"there is no best trial. Last error: {tally.last_error}",
                "Raise max_trial_count, or turn early stopping off or raise "
                "early_stopping_min_trials, and continue the study under the same name.",
            )

    # --- the MLflow parent run -----------------------------------------------------------

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """The parent run is RUNNING while the flow works, then FINISHED, FAILED or KILLED."""
        client = MlflowClient(self.settings.tracking_uri, self.settings.registry_uri)
        client.update_run(self.job.parent_run_id, status="RUNNING")
        status = "FAILED"
        try:
            yield
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            client.set_terminated(self.job.parent_run_id, status)


def open_study(
    spec: TuningSpec,
    train_data: Path,
    val_data: Path,
    *,
    transform: TransformSpec,
    settings: Settings,
    data_version: dict[str, str] | None = None,
) -> Study:
    """Create the study, or continue the one of that name; ready to ask for trials.

    Checks the spec and the data first (InvalidTuningSpecError, InvalidImageDirectoryError);
    refuses to continue a study started with another search space or data, or one that a live
    flow on this machine is tuning now (InvalidParameterError). Trials left RUNNING are
    recovered (see the module), the grid is queued, and the parent MLflow run is created or
    reopened.
    """
    quiet_optuna()
    spec.check()
    name = spec.study_name or datetime.now(UTC).strftime("tune-%Y%m%d-%H%M%S")
    identity = {
        **spec.identity(),
        "transform": transform.model_dump(mode="json"),
        "data": {
            role: _fingerprint(path) for role, path in (("train", train_data), ("val", val_data))
        },
    }
    ref = storage_ref(settings, name)
    storage = open_storage(ref, settings)
    study = optuna.create_study(
        study_name=name,
        storage=storage,
        direction=spec.goal,
        load_if_exists=True,
        pruner=make_pruner(
            spec.early_stopping, spec.early_stopping_min_trials, spec.early_stopping_min_epochs
        ),
    )
    check_identity(study, name, identity)
    take_ownership(study, name)
    study.sampler = make_sampler(spec, len(study.get_trials(deepcopy=False)))
    log = step_logger(__name__)
    recovered = recover_interrupted(study, storage)
    if recovered:
        log.info("study %s: trials %s were interrupted; queued again", name, recovered)
    if spec.algorithm == "grid":
        queue_grid(study, spec)
    job = TrialJob(
        study_name=name,
        storage=ref,
        spec=spec,
        train_data=Path(train_data).resolve(),
        val_data=Path(val_data).resolve(),
        transform=transform,
        data_version=dict(data_version or {}),
        parent_run_id=parent_run(study, spec, settings),
        folder=study_dir(settings, name),
    )
    opened = Study(spec, study, storage, job, settings)
    tally = opened.tally()
    log.info(
        "study %s in %s: %d of %d trials finished (%d complete, %d pruned, %d failed)",
        name,
        describe_storage(ref),
        tally.finished,
        opened.budget(),
        tally.complete,
        tally.pruned,
        tally.failed,
    )
    return opened


def _fingerprint(root: Path) -> str:
    read_manifest(Path(root))  # a clear InvalidImageDirectoryError for a folder that is not one
    return manifest_fingerprint(Path(root))
