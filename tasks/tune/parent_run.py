"""The study's MLflow parent run: created by the first flow, reopened by every later one.

Each trial's training run is nested under it. What a continued study keeps (its identity) is
logged as parameters once; what may change between flows (counts, algorithm) as tags.
"""

from __future__ import annotations

import contextlib
import json

import optuna
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from tasks.shared.settings import Settings
from tasks.shared.tracking import configure_mlflow
from tasks.tune.records import PARENT_RUN
from tasks.tune.spec import TuningSpec


def parent_run(study: optuna.Study, spec: TuningSpec, settings: Settings) -> str:
    """The study's MLflow run: created on the first flow, found again by every later one."""
    experiment_id = configure_mlflow(settings)
    client = MlflowClient(settings.tracking_uri, settings.registry_uri)
    run_id = study.user_attrs.get(PARENT_RUN)
    if run_id is not None:
        with contextlib.suppress(MlflowException):
            client.get_run(run_id)
            tag_counts(client, run_id, spec)
            return run_id
    run_id = client.create_run(
        experiment_id,
        run_name=study.study_name,
        tags={"imageops.step": "tune", "imageops.study": study.study_name},
    ).info.run_id
    # Parameters are immutable in MLflow: only what a continued study keeps (its identity).
    fixed = {
        "metric": spec.metric,
        "goal": spec.goal,
        "measurement": spec.measurement,
        "model": spec.model,
        "pretrained": spec.pretrained,
        "memory_efficient": spec.memory_efficient,
        "zero_init_residual": spec.zero_init_residual,
        "parameters": json.dumps(
            [{k: v for k, v in p.record().items() if v is not None} for p in spec.parameters]
        ),
        **{f"train.{k}": v for k, v in spec.train.model_dump().items()},
    }
    for key, value in fixed.items():
        client.log_param(run_id, key, str(value)[:6000])
    tag_counts(client, run_id, spec)
    study.set_user_attr(PARENT_RUN, run_id)
    return run_id


def tag_counts(client: MlflowClient, run_id: str, spec: TuningSpec) -> None:
    """What may change between flows of a study, as tags (the latest flow's)."""
    for key in (
        "algorithm",
        "max_trial_count",
        "parallel_trial_count",
        "max_failed_trial_count",
        "early_stopping",
        "early_stopping_min_trials",
        "early_stopping_min_epochs",
        "seed",
    ):
        client.set_tag(run_id, f"tune.{key}", str(getattr(spec, key)))
