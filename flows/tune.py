"""The tune flow: hyperparameter tuning the Vertex AI way, each trial a real training run.

It keeps up to ``parallel_trial_count`` trials running (tasks here, or flow runs of the
``tune-trial`` deployment) until ``max_trial_count`` finished or too many failed, then publishes the
trials table and registers the best model as ``@challenger``. The same study name continues the
study. Details: docs/tuning.md#the-tune-flow.
"""

# No `from __future__ import annotations` here: a flow served with `serve()` runs from a
# by-value pickle whose globals hold only what the body uses, so the parameter types must be
# real classes in the signature, not names to look up.
from pathlib import Path
from typing import Annotated

from prefect.deployments import run_deployment
from prefect.futures import PrefectFuture, as_completed
from prefect.task_runners import ThreadPoolTaskRunner

from flows.config import DEMO_TRANSFORM
from models.transform_spec import TransformSpec
from tasks.data.data_refs import REF_SYNTAX, resolve_data
from tasks.data.transform import applied_to, data_transform
from tasks.inference.export import export_task
from tasks.registry.promote import CHALLENGER
from tasks.registry.register import register_task
from tasks.shared.flow_parameters import checked_flow
from tasks.shared.forms import form_field
from tasks.shared.settings import get_settings, redact_uri
from tasks.shared.step import name_flow_run, step
from tasks.train.torchrun import trainings_stop_when_interrupted
from tasks.tune.gpus import check_study_gpus, local_gpus
from tasks.tune.records import AskedTrial, TrialJob, TrialOutcome
from tasks.tune.report import StudyResult, report_study
from tasks.tune.spec import MAX_PARALLEL_TRIALS, TuningSpec
from tasks.tune.study import open_study
from tasks.tune.trial import recorded_outcome, run_trial


# The pool bounds nothing here (the flow keeps parallel_trial_count running); it only must not
# be the smaller limit.
def study_transform(transform: TransformSpec | None, train: Path, val: Path) -> TransformSpec:
    """The given transform, else the one the data was prepared with, else the demo's."""
    prepared = data_transform({"train": (train, applied_to(train)), "val": (val, applied_to(val))})
    return transform or prepared or DEMO_TRANSFORM


def run_trial_anywhere(
    job: TrialJob, asked: AskedTrial, deployment: str | None = None
) -> TrialOutcome:
    """The trial here, or, with ``deployment`` (``<flow>/<deployment>``), as a flow run of it.

    A deployed trial runs on the deployment's work pool (a worker on another machine, sharing
    the study's database, the MLflow server and the storage of ``job.folder``); this waits for
    it and reads the outcome from the study. A flow run that ended without telling the study
    is failed by the tune flow (:meth:`tasks.tune.study.Study.settle`).
    """
    if deployment is None:
        return run_trial(job, asked)
    flow_run = run_deployment(
        deployment,
        parameters={"job": job.model_dump(mode="json"), "asked": asked.model_dump(mode="json")},
        timeout=None,  # wait for it, however long the training takes
        flow_run_name=f"{job.study_name}-trial-{asked.number}",
    )
    state = flow_run.state
    if state is not None and not state.is_completed():
        raise RuntimeError(f"flow run {flow_run.name} ended {state.name}: {state.message}")
    return recorded_outcome(job, asked.number)


# No retries: a trial's failure is counted by the study, and a crash is settled by the flow.
trial_task = step(run_trial_anywhere, name="tune-trial", retries=0)


@checked_flow(
    name="imageops-tune",
    task_runner=ThreadPoolTaskRunner(max_workers=MAX_PARALLEL_TRIALS),
    log_prints=True,
)
def tune_flow(
    spec: Annotated[
        TuningSpec | None,
        form_field(
            title="Tuning spec",
            description="The study: parameters, metric, trials (see "
            "tuning.yaml). Empty: the example study of the digits demo.",
        ),
    ] = None,
    train_data: Annotated[
        str,
        form_field(
            title="Training data",
            description="Labeled ImageDirectory: a path from the project root, or a data set "
            f"version as {REF_SYNTAX}, e.g. digits/train@latest (fetched from the DVC remote).",
        ),
    ] = "data/digits/train",
    val_data: Annotated[
        str,
        form_field(
            title="Validation data",
            description="Labeled ImageDirectory the metric is on: a path or a data set version "
            "(digits/val@latest).",
        ),
    ] = "data/digits/val",
    transform: Annotated[
        TransformSpec | None,
        form_field(
            title="Image transformation",
            description="Default: the transform the data was prepared with (Apply Image "
            "Transformation), else the demo's (32x32 digits, as the example study expects).",
        ),
    ] = None,
    data_version: Annotated[
        dict[str, str] | None,
        form_field(
            title="Data versions",
            description='DVC md5s of the data sets, e.g. {"train": "..."}, recorded on each '
            "trial's run and the registered model; empty: those of the data sets named by "
            "version, else none recorded.",
        ),
    ] = None,
    register_best: Annotated[
        bool, form_field(title="Register the best model", description="As @challenger.")
    ] = True,
    trial_deployment: Annotated[
        str | None,
        form_field(
            title="Trial deployment",
            description="<flow>/<deployment> that runs one trial (imageops-tune-trial/"
            "tune-trial): trials become flow runs on its work pool. Empty: tasks of this flow.",
        ),
    ] = None,
) -> StudyResult:
    """Run (or continue) the study ``spec`` and register its best model as @challenger.

    Trials that run here share this machine's GPUs (tasks.tune.gpus). Raises InvalidTuningSpecError
    before any trial for a spec that cannot make a study here, and TuningFailedError when more than
    ``max_failed_trial_count`` trials failed or none completed (the trials table is published either
    way). Details: docs/tuning.md#tune_flow.
    """
    settings = get_settings()
    spec = (spec or TuningSpec()).check()
    if trial_deployment is None:  # the trials train here, sharing this machine's GPUs
        check_study_gpus(spec, local_gpus())
    data = {
        "train": resolve_data(train_data, "training data", settings),
        "val": resolve_data(val_data, "validation data", settings),
    }
    train, val = data["train"].path, data["val"].path
    if data_version is None:
        data_version = {part: d.md5 for part, d in data.items() if d.md5} or None
    study = open_study(
        spec, train, val, transform=study_transform(transform, train, val),
        settings=settings, data_version=data_version,
    )  # fmt: skip
    name_flow_run(f"tune-{study.job.study_name}")
    # A stop (Ctrl-C, SIGTERM) stops the running trials first: the task runner waits for them.
    with study.tracking(), trainings_stop_when_interrupted():
        try:
            running: dict[PrefectFuture, int] = {}
            while True:
                while study.can_ask(len(running)):
                    asked = study.ask()
                    trial = trial_task.with_options(task_run_name=f"trial-{asked.number}")
                    running[trial.submit(study.job, asked, trial_deployment)] = asked.number
                if not running:
                    break
                done = next(as_completed(list(running)))
                study.settle(running.pop(done), _error(done))
        finally:
            result = report_study(study)
        study.raise_if_failed()
    best = result.best
    if register_best and best is not None and best.model_dir is not None:
        version = study.registered_version(best)
        if version is None:
            export_task(best.model_dir, sample=val)
            registered = register_task(
                best.model_dir, data_version=data_version, alias=CHALLENGER,
                data_refs={part: d.ref for part, d in data.items() if d.ref}, validation=val,
            )  # fmt: skip
            version = study.record_registration(best, registered.version)
        result = result.model_copy(update={"registered_version": version})
    return result


@checked_flow(name="imageops-tune-trial", log_prints=True)
def trial_flow(
    job: Annotated[
        TrialJob,
        form_field(
            title="Study",
            description="The study the trial belongs to: its storage, spec, data and folder "
            "(the tune flow fills it).",
            filled_by_a_flow=True,
        ),
    ],
    asked: Annotated[
        AskedTrial,
        form_field(
            title="Trial",
            description="The trial's number and the values it trains with (the tune flow fills "
            "it).",
            filled_by_a_flow=True,
        ),
    ],
) -> TrialOutcome:
    """One trial of a study as a flow run of its own: the ``tune-trial`` deployment.

    The tune flow starts it on the work pool with ``trial_deployment``; the study's storage
    (a database), MLflow and the study folder must be shared with the worker's machine.
    """
    return run_trial(job, asked)


def _error(future: PrefectFuture) -> str | None:
    """Why a trial task ended without a result (a crash, not a trial failure it told)."""
    try:
        future.result()
    except Exception as exc:
        return redact_uri(f"{type(exc).__name__}: {exc}")
    return None


def tune_spec_file(path: Path, **overrides: object) -> TuningSpec:
    """A spec from a tuning.yaml-shaped file, with the fields given (e.g. study_name) replaced."""
    spec = TuningSpec.from_yaml(path)
    given = {k: v for k, v in overrides.items() if v is not None}
    return TuningSpec.checked(**{**spec.model_dump(), **given}) if given else spec
