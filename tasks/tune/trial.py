"""One trial: a real training run with the trial's values, nested under the study's MLflow run.

It writes its model directory, takes its GPUs (:mod:`tasks.tune.gpus`), opens its training run (an
interrupted trial's is continued) and trains, rank 0 reporting each epoch so the study can prune it;
then it tells the study itself, so it runs anywhere (a task, or a flow run on a work pool). A pruned
trial's model is still written. Details: docs/tuning.md#trials.
"""

from __future__ import annotations

import json
import time

import optuna
from mlflow import MlflowClient
from optuna.trial import TrialState

from tasks.shared.settings import get_settings, redact_uri
from tasks.shared.step import step_logger
from tasks.train.build_model import build_model
from tasks.train.launch import open_run, train
from tasks.train.params import TrialHook
from tasks.train.request import TrainRequest
from tasks.tune.gpus import gpu_environment, gpus_for, local_gpus
from tasks.tune.records import (
    ERROR,
    MODEL_DIR,
    RUN_ID,
    AskedTrial,
    TrialJob,
    TrialOutcome,
    outcome_of,
)
from tasks.tune.spec import TuningSpec
from tasks.tune.storage import open_storage, quiet_optuna

UNTRAINED = "untrained"
MODEL = "model"
VALUE_METRIC = "tuning/value"
GPUS_TAG = "imageops.gpus"  # the GPUs a trial trained on (CUDA_VISIBLE_DEVICES of its torchrun)


def measure(history: list[dict[str, float]], spec: TuningSpec) -> float:
    """The trial's value: its best epoch's metric (by the goal), or its last epoch's."""
    series = [float(entry[spec.metric]) for entry in history]
    if spec.measurement == "last":
        return series[-1]
    return max(series) if spec.goal == "maximize" else min(series)


def run_trial(job: TrialJob, asked: AskedTrial) -> TrialOutcome:
    """Train the trial ``asked`` of ``job``'s study and tell the study how it went.

    Any failure of the training (a diverging loss, a refused batch size, a crashed worker)
    is the trial's: it is told FAIL with the error, and returned, not raised. An interrupt is
    not a failure: the trial stays RUNNING for the next flow to recover.
    """
    quiet_optuna()
    settings = get_settings()
    log = step_logger(__name__)
    storage = open_storage(job.storage, settings)
    study = optuna.load_study(
        study_name=job.study_name, storage=storage, sampler=optuna.samplers.RandomSampler()
    )
    study_id = storage.get_study_id_from_name(job.study_name)
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, asked.number)
    client = MlflowClient(settings.tracking_uri, settings.registry_uri)
    spec, folder = job.spec, job.trial_folder(asked)
    run_id = None
    started = time.monotonic()
    try:
        params = spec.trial_params(asked.values)
        untrained = folder / UNTRAINED
        build_model(spec.trial_model(asked.values), untrained)
        request = TrainRequest(
            model=untrained,
            train_data=job.train_data,
            val_data=job.val_data,
            out=folder / MODEL,
            params=params,
            transform=job.transform,
            data_version=job.data_version,
            run_name=f"{job.study_name} trial {asked.number}",
        )
        slots = local_gpus()
        need = gpus_for(params, len(slots))
        if need > slots.free:
            log.info("trial %d waits for %d GPUs (%d free)", asked.number, need, slots.free)
        # Released however the trial ends: completed, pruned, failed.
        with slots.take(need, f"Trial {asked.number} (nproc_per_node {need} on CUDA)") as gpus:
            run_id = open_run(request, settings)
            storage.set_trial_user_attr(trial_id, RUN_ID, run_id)
            _tag_run(client, run_id, job, asked, gpus)
            hook = TrialHook(
                storage=job.storage,
                study_name=job.study_name,
                trial_number=asked.number,
                metric=spec.metric,
                early_stopping=spec.early_stopping,
                min_trials=spec.early_stopping_min_trials,
                min_epochs=spec.early_stopping_min_epochs,
            )
            launch = {"run_id": run_id, "tuning": hook, "env": gpu_environment(gpus)}
            result = train(request.model_copy(update=launch), settings)
    except Exception as exc:  # the trial's failure, counted by the study; never the flow's
        error = redact_uri(f"{type(exc).__name__}: {exc}")
        log.warning("trial %d failed after %.0f s: %s", asked.number, _since(started), error)
        storage.set_trial_user_attr(trial_id, ERROR, error[:4000])
        study.tell(asked.number, state=TrialState.FAIL, skip_if_finished=True)
        if run_id is not None:
            client.set_tag(run_id, "imageops.trial_state", TrialState.FAIL.name)
        return outcome_of(storage.get_trial(trial_id))
    storage.set_trial_user_attr(trial_id, MODEL_DIR, str(result.model_dir))
    value = measure(result.history, spec)
    if result.pruned:
        study.tell(asked.number, state=TrialState.PRUNED, skip_if_finished=True)
    else:
        study.tell(asked.number, value, skip_if_finished=True)
    outcome = outcome_of(storage.get_trial(trial_id))
    client.set_tag(run_id, "imageops.trial_state", outcome.state)
    client.log_metric(run_id, VALUE_METRIC, value)
    log.info(
        "trial %d %s after %.0f s: %s = %.4f (%s over %d epochs)",
        asked.number,
        outcome.state,
        _since(started),
        spec.metric,
        value,
        spec.measurement,
        len(result.history),
    )
    return outcome


def recorded_outcome(job: TrialJob, number: int) -> TrialOutcome:
    """Trial ``number`` of ``job``'s study as the study recorded it (it ran elsewhere)."""
    storage = open_storage(job.storage)
    study_id = storage.get_study_id_from_name(job.study_name)
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
    return outcome_of(storage.get_trial(trial_id))


def _since(started: float) -> float:
    return time.monotonic() - started


def _tag_run(
    client: MlflowClient, run_id: str, job: TrialJob, asked: AskedTrial, gpus: tuple[str, ...]
) -> None:
    """Nest the training run under the study's run, say which trial it is and on which GPUs.

    The GPUs are a tag, not a parameter: a re-run of an interrupted trial continues the same
    run, maybe on other GPUs, and MLflow parameters cannot change.
    """
    tags = {
        "mlflow.parentRunId": job.parent_run_id,  # what the MLflow UI nests runs by
        "imageops.study": job.study_name,
        "imageops.trial": str(asked.number),
        "imageops.tuned": json.dumps(asked.values, sort_keys=True),
    }
    if gpus:
        tags[GPUS_TAG] = ",".join(gpus)
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
