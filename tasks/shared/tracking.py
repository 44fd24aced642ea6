"""MLflow wiring: the one place that points MLflow at the settings' tracking and registry stores."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from models.errors import ImageOpsError
from tasks.shared.database_templates import mlflow_database
from tasks.shared.errors import RegistryError
from tasks.shared.project_lock import taking_turns
from tasks.shared.settings import Settings, redact_uri

LOCK_TIMEOUT_S = 600.0  # another process migrating a new MLflow database on a slow machine


# MLflow 3's UI opens an experiment of unknown kind on its GenAI overview (traces, evaluations);
# this kind opens it on its training runs.
EXPERIMENT_KIND = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"
MODEL_TRAINING_VIEW = "workflowType=machine_learning"  # the UI's query parameter for that view


def logged_value(value: float) -> float:
    """A metric or number as imageops logs it to MLflow: 7 significant digits (float32's, what
    training computes in), so the UI shows 0.02768140, not 0.027681401349539423."""
    return float(f"{value:.7g}")


def summary_metric(*parts: str) -> str:
    """The MLflow name of a run's one-figure summary: ``best_val_top1``, ``eval_accuracy``.

    MLflow's charts file a metric under the part of its name before the last "/", show those
    sections alphabetically, and the names without one ("Model metrics") after them: without a
    "/", the summaries come after the per-epoch curves (``train/...``, ``val/...``) a person
    reads first, not before them as ``best/...`` and ``eval/...`` did (issue 47).
    """
    return "_".join(part.replace("/", "_") for part in parts)


def configure_mlflow(settings: Settings) -> str:
    """Point MLflow at the settings' stores and return the experiment id (created if missing).

    With a local store, a new experiment gets its artifact location under the project working
    folder, so artifacts never land in a ``mlruns/`` beside wherever the command happened to
    run. With an ``mlflow server`` the server decides (its artifact store, proxied), so every
    machine that logs reaches the same artifacts.
    """
    settings.home_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # as Settings.apply
    mlflow.set_tracking_uri(settings.tracking_uri)
    mlflow.set_registry_uri(settings.registry_uri)
    with _store_creation(settings.tracking_uri):
        client = MlflowClient()  # opens the store: creates and migrates a new database
    experiment = client.get_experiment_by_name(settings.mlflow_experiment)
    if experiment is not None:
        if experiment.tags.get(EXPERIMENT_KIND) is None:  # made by an older imageops, or by hand
            client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)
        return experiment.experiment_id
    try:
        server = settings.tracking_uri.startswith(("http://", "https://"))
        return client.create_experiment(
            settings.mlflow_experiment,
            artifact_location=None if server else settings.artifact_location,
            tags={EXPERIMENT_KIND: MODEL_TRAINING},
        )
    except mlflow.exceptions.MlflowException:
        # Another process created it between our look-up and our create.
        return client.get_experiment_by_name(settings.mlflow_experiment).experiment_id


@contextmanager
def _store_creation(uri: str) -> Iterator[None]:
    """A lock for the first use of a SQLite store, which creates and migrates its tables; a new
    store starts from the migrated template (tasks.shared.database_templates).

    Two processes doing that at once on one new file fail (alembic: "expected to match one
    row"); two pipeline runs started together in a new project would. A server migrates alone.
    """
    if not uri.startswith("sqlite:///"):
        yield
        return
    database = Path(uri.removeprefix("sqlite:///"))
    with (
        taking_turns(
            database.with_name(f"{database.name}.lock"),
            LOCK_TIMEOUT_S,
            RegistryError,
            "another process creating this MLflow database",
            "Check for a stuck `imageops` or `mlflow` process using it and stop it, then retry.",
        ),
        mlflow_database(database),
    ):
        yield


@contextmanager
def mlflow_run(
    settings: Settings, run_id: str | None = None, run_name: str | None = None
) -> Iterator[str]:
    """Make ``run_id`` (resumed) or a new run in the settings' experiment the active run.

    Yields the run id. A step that logs into an existing run (the training run, a flow's run)
    resumes it instead of opening a second one; when that run is already active here it is used
    as is and left open for its owner to end. A new run is ended when the block ends (FAILED if
    it raised); a resumed run gets back the status it had, however the block ends (a run still
    training elsewhere stays RUNNING, a failed one FAILED, a finished one FINISHED).
    """
    experiment_id = configure_mlflow(settings)
    client = MlflowClient()
    active = mlflow.active_run()
    if run_id is not None and active is not None and active.info.run_id == run_id:
        yield run_id
        return
    status = None
    if run_id is not None:
        try:
            status = client.get_run(run_id).info.status
        except mlflow.exceptions.MlflowException as exc:
            raise ImageOpsError(
                f"MLflow run {run_id} does not exist in {redact_uri(settings.tracking_uri)}.",
                "Pass the id of a run in this tracking store, or none to start a new run.",
            ) from exc
    try:
        with mlflow.start_run(
            run_id=run_id,
            experiment_id=None if run_id else experiment_id,
            run_name=None if run_id else run_name,
            nested=active is not None,
        ) as run:
            yield run.info.run_id
    finally:
        # Also when the block failed (a full disk while registering): MLflow would end the
        # resumed run FAILED, and a training that finished would read as failed or running.
        if status is not None and client.get_run(run_id).info.status != status:
            client.update_run(run_id, status=status)


def ui_url(settings: Settings, path: str) -> str | None:
    """A link into the MLflow UI (``path`` after ``#/``) when tracking goes to an MLflow server.

    A local SQLite store has no UI until someone runs ``mlflow ui``, so there is no link to give.
    Links land in logs and Prefect artifacts, so a password in the URI is masked. Each link
    asks for MLflow's model-training view (``workflowType=machine_learning``): MLflow 3's UI
    otherwise opens on its GenAI pages (traces, token usage), whatever the experiment's kind,
    with the runs and the registry out of the sidebar.
    """
    uri = redact_uri(settings.tracking_uri)
    if not uri.startswith(("http://", "https://")):
        return None
    path = path.lstrip("/")
    return f"{uri.rstrip('/')}/#/{path}{'&' if '?' in path else '?'}{MODEL_TRAINING_VIEW}"


def run_url(settings: Settings, run_id: str, tab: str = "") -> str | None:
    """The MLflow UI page of a run (``tab``: e.g. ``artifacts``); None without a server."""
    if ui_url(settings, "") is None:
        return None  # no UI to link to, and no reason to ask the store for the run
    run = MlflowClient(tracking_uri=settings.tracking_uri).get_run(run_id)
    page = f"experiments/{run.info.experiment_id}/runs/{run_id}"
    return ui_url(settings, f"{page}/{tab}" if tab else page)


def model_version_url(settings: Settings, name: str, version: str | int) -> str | None:
    """The MLflow UI page of a registered model version."""
    return ui_url(settings, f"models/{name}/versions/{version}")
