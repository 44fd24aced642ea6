"""Where every piece of state lives: one settings object, read from ``IMAGEOPS_*`` variables.

The embedded defaults put everything under one project working folder (``.imageops/``): Prefect's
ephemeral API database, MLflow's SQLite tracking and registry, MLflow artifacts, the DVC remote and
the training runs. Scaling out changes settings only: point ``IMAGEOPS_MLFLOW_TRACKING_URI`` at an
``mlflow server``, ``IMAGEOPS_PREFECT_API_URL`` at a ``prefect server``, ``IMAGEOPS_DVC_REMOTE_URL``
and ``IMAGEOPS_CHECKPOINT_URL`` at an S3 bucket (``IMAGEOPS_S3_ENDPOINT_URL`` at its server),
``IMAGEOPS_TUNING_STORAGE`` at a database for Optuna, ``IMAGEOPS_RAY_ADDRESS`` at the team's Ray
cluster. The code path stays the same.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from functools import cached_property
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

# Telemetry stays off: the machines this runs on often have no internet, and users did not ask.
_QUIET_ENVIRONMENT = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "DO_NOT_TRACK": "1",
}

# scheme://user:password@host: the userinfo ends at the last "@" of the authority (which ends at
# the first "/", "?", "#" or space), so a password with a raw "@" is masked whole.
_CREDENTIALS = re.compile(
    r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:@/?#]*):[^\s/?#]*@(?=[^\s@/?#]*(?:[/?#\s]|$))"
)


def redact_uri(text: str) -> str:
    """Mask the password of every ``scheme://user:password@host`` in ``text`` as ``user:***@``.

    Settings URIs (tracking, registry, tuning storage, DVC remote, Prefect API) may carry a
    password, and messages, logs and reports outlive the shell they were typed in. The host
    stays, so a message still says which server failed; text without credentials is unchanged.
    """
    return _CREDENTIALS.sub(r"\g<head>:***@", text)


class RedactingFormatter(logging.Formatter):
    """A log formatter whose lines (tracebacks included) never carry a URI's password."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_uri(super().format(record))


class Settings(BaseSettings):
    """Every location imageops reads or writes. Relative paths resolve against ``project_root``."""

    model_config = SettingsConfigDict(env_prefix="IMAGEOPS_", extra="forbid", frozen=True)

    project_root: Path = Field(
        default_factory=Path.cwd,
        description="The DVC repository root (also the git root when there is one).",
    )
    home: Path = Field(
        default=Path(".imageops"),
        description="Project working folder: Prefect state, MLflow database, DVC remote, runs.",
    )
    data_dir: Path = Field(default=Path("data"), description="DVC-tracked data sets.")
    mlflow_tracking_uri: str | None = Field(
        default=None, description="MLflow tracking server; default: SQLite under `home`."
    )
    mlflow_registry_uri: str | None = Field(
        default=None, description="MLflow model registry; default: the tracking URI."
    )
    mlflow_experiment: str = Field(default="imageops", description="MLflow experiment name.")
    registered_model_name: str = Field(
        default="imageops-classifier", description="Name of the model in the MLflow registry."
    )
    prefect_api_url: str | None = Field(
        default=None, description="Prefect server API; default: the local ephemeral API."
    )
    dvc_remote_url: str | None = Field(
        default=None, description="DVC remote; default: a folder under `home`."
    )
    s3_endpoint_url: str | None = Field(
        default=None,
        description="S3 server of every s3:// URL (DVC remote, MLflow artifacts, checkpoints), "
        "e.g. http://server:8333 for SeaweedFS or MinIO; default: AWS. The keys come from "
        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, never from settings.",
    )
    checkpoint_url: str | None = Field(
        default=None,
        description="Where training checkpoints are copied so any machine can resume a run: "
        "s3://bucket/prefix or a folder; default: only in the run folder.",
    )
    webhook_secret: SecretStr | None = Field(
        default=None,
        description="Secret the MLflow registry webhook signs with (HMAC-SHA256); the webhook "
        "receiver refuses to start without it.",
    )
    ray_address: str | None = Field(
        default=None,
        description="The team's Ray cluster, HOST:6379 of its head (the join file of `imageops "
        "team join` sets it): where a score flow run with cluster=team scores, as the runs a "
        "promotion starts do; default: none, such a run scores on its own machine.",
    )
    tuning_storage: str | None = Field(
        default=None,
        description="Optuna storage of the tuning studies: a database URL every machine reaches "
        "(postgresql://...); default: one journal file per study under `home`/tuning.",
    )
    keep_checkpoints: bool = Field(
        default=False,
        description="Keep a FINISHED training run's checkpoint and best weights (run folder and "
        "checkpoint store); default: removed once the run is FINISHED (the model folder and "
        "MLflow have what it produced). FAILED and KILLED runs always keep them, to resume.",
    )
    weights_cache: Path | None = Field(
        default=None,
        description="Pretrained weights cache (TORCH_HOME); default: `home`/torch.",
    )

    def _resolve(self, path: Path) -> Path:
        return path if path.is_absolute() else (self.project_root / path).resolve()

    @cached_property
    def home_dir(self) -> Path:
        return self._resolve(self.home)

    @cached_property
    def data_path(self) -> Path:
        return self._resolve(self.data_dir)

    @cached_property
    def runs_dir(self) -> Path:
        """One folder per training run: configuration, checkpoints, rank logs, the model."""
        return self.home_dir / "runs"

    @cached_property
    def outputs_dir(self) -> Path:
        """One folder per flow run: the untrained and trained model, the scored table."""
        return self.home_dir / "outputs"

    @cached_property
    def tracking_uri(self) -> str:
        if self.mlflow_tracking_uri:
            return self.mlflow_tracking_uri
        return f"sqlite:///{self.home_dir / 'mlflow.db'}"

    @cached_property
    def registry_uri(self) -> str:
        return self.mlflow_registry_uri or self.tracking_uri

    @cached_property
    def artifact_location(self) -> str:
        """Where a new MLflow experiment keeps its artifacts (only used when we create it)."""
        return (self.home_dir / "mlartifacts").as_uri()

    @cached_property
    def prefect_auth_file(self) -> Path:
        """The auth string of `imageops serve`'s Prefect API (mode 0600), which imageops' own
        commands send to that API (:meth:`environment`)."""
        return self.home_dir / "stack" / "prefect-auth-string"

    @cached_property
    def dvc_remote(self) -> str:
        return self.dvc_remote_url or str(self.home_dir / "dvc-remote")

    @cached_property
    def torch_home(self) -> Path:
        return self._resolve(self.weights_cache) if self.weights_cache else self.home_dir / "torch"

    def environment(self) -> dict[str, str]:
        """Variables that child processes and the libraries read at import time."""
        env = dict(_QUIET_ENVIRONMENT)
        env["PREFECT_HOME"] = str(self.home_dir / "prefect")
        env["MLFLOW_TRACKING_URI"] = self.tracking_uri
        env["MLFLOW_REGISTRY_URI"] = self.registry_uri
        env["TORCH_HOME"] = str(self.torch_home)
        if self.prefect_api_url:
            env["PREFECT_API_URL"] = self.prefect_api_url
            # `imageops serve`'s API takes only its auth string: this project's commands send it
            # there (a loopback URL) unless the shell gives one; never to another machine.
            local = urlsplit(self.prefect_api_url).hostname in ("127.0.0.1", "localhost", "::1")
            if local and "PREFECT_API_AUTH_STRING" not in os.environ:
                with contextlib.suppress(OSError):
                    env["PREFECT_API_AUTH_STRING"] = self.prefect_auth_file.read_text().strip()
        if self.s3_endpoint_url:  # boto3, DVC's s3fs and MLflow's artifact client read these
            env["AWS_ENDPOINT_URL"] = self.s3_endpoint_url
            env["MLFLOW_S3_ENDPOINT_URL"] = self.s3_endpoint_url
            env["IMAGEOPS_S3_ENDPOINT_URL"] = self.s3_endpoint_url
        if self.checkpoint_url:  # the training workers upload their checkpoints there
            env["IMAGEOPS_CHECKPOINT_URL"] = self.checkpoint_url
        if self.tuning_storage:  # a training worker of a tuning trial reports to it
            env["IMAGEOPS_TUNING_STORAGE"] = self.tuning_storage
        # Pass our own settings on, resolved, so a torchrun worker sees exactly what we see.
        env["IMAGEOPS_PROJECT_ROOT"] = str(self.project_root.resolve())
        env["IMAGEOPS_HOME"] = str(self.home_dir)
        return env

    def apply(self) -> Settings:
        """Export :meth:`environment` into this process (before Prefect or MLflow is imported)."""
        # Owner-only when new: databases, the DVC remote and artifacts are no one else's business
        # (`imageops serve` and `team` also tighten an older one, before their servers start).
        self.home_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Settings are the one place that says where things live: they override any stray
        # MLFLOW_* or PREFECT_HOME left in the shell, so two runs never write to different stores.
        os.environ.update(self.environment())
        return self


def get_settings() -> Settings:
    """Settings from the environment, as they are now (tests change the environment)."""
    return Settings()
