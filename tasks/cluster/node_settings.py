"""The servers every node of a cluster job uses, as the driver sees them: its settings, passed on.

A node's own settings (``IMAGEOPS_HOME``, credentials: the S3 keys its ``imageops team join``
gave it) stay its own; the servers (tracking, registry, DVC remote, checkpoint store, S3 endpoint)
are the driver's, so every node reads and writes the same state. No credentials travel.
"""

from __future__ import annotations

import os
from typing import Any

from tasks.shared.settings import Settings

# Settings fields passed on only when set: a node without them uses its own default.
_OPTIONAL = ("checkpoint_url", "s3_endpoint_url")


def server_settings(settings: Settings) -> dict[str, str]:
    """The servers every node must use, as ``IMAGEOPS_*`` variables (no credentials)."""
    servers = {
        "IMAGEOPS_MLFLOW_TRACKING_URI": settings.tracking_uri,
        "IMAGEOPS_MLFLOW_REGISTRY_URI": settings.registry_uri,
        "IMAGEOPS_MLFLOW_EXPERIMENT": settings.mlflow_experiment,
        "IMAGEOPS_DVC_REMOTE_URL": settings.dvc_remote,
    }
    for name in _OPTIONAL:
        value = getattr(settings, name, None)
        if value:
            servers[f"IMAGEOPS_{name.upper()}"] = str(value)
    return servers


def runtime_env(settings: Settings) -> dict[str, Any]:
    """A Ray runtime environment with the servers every node must use: for a job's actors."""
    return {"env_vars": server_settings(settings)}


def node_settings(servers: dict[str, str]) -> Settings:
    """On a node (in its actor or task): the driver's servers in this process, its settings."""
    os.environ.update(servers)
    return Settings()
