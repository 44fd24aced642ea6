"""MLflow wiring: the one place that points MLflow at the settings' tracking and registry stores."""

from __future__ import annotations

import mlflow
from mlflow.tracking import MlflowClient

from tasks.settings import Settings


def configure_mlflow(settings: Settings) -> str:
    """Point MLflow at the settings' stores and return the experiment id (created if missing).

    A new experiment gets its artifact location under the project working folder, so artifacts
    never land in a ``mlruns/`` beside wherever the command happened to run.
    """
    settings.home_dir.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(settings.tracking_uri)
    mlflow.set_registry_uri(settings.registry_uri)
    client = MlflowClient()
    experiment = client.get_experiment_by_name(settings.mlflow_experiment)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(
            settings.mlflow_experiment, artifact_location=settings.artifact_location
        )
    except mlflow.exceptions.MlflowException:
        # Another process created it between our look-up and our create.
        return client.get_experiment_by_name(settings.mlflow_experiment).experiment_id
