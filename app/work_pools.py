"""The Prefect work pools imageops runs on, and their base job templates.

The templates are data (``deployments/work-pools/<pool>.json``, what ``prefect work-pool create``
takes), so the CLI, the README and ``imageops serve`` create the same pools: ``local`` (process),
``gpu-docker`` and ``gpu-k8s`` (GPUs and /dev/shm as job variables).
Details: docs/stack.md#work-pools.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect.client.schemas.actions import WorkPoolCreate

# pool name -> Prefect worker type (the `--type` of `prefect work-pool create`)
POOLS: dict[str, str] = {
    "local": "process",
    "gpu-docker": "docker",
    "gpu-k8s": "kubernetes",
}

# The templates live beside prefect.yaml, not in the package: operators read and edit them there.
TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "deployments" / "work-pools"


def template_path(name: str) -> Path:
    """The base job template file of pool ``name`` (one of ``POOLS``)."""
    if name not in POOLS:
        raise ValueError(f"Unknown work pool {name!r}: expected one of {', '.join(POOLS)}.")
    return TEMPLATE_DIR / f"{name}.json"


def base_job_template(name: str) -> dict[str, Any]:
    """The base job template of pool ``name``: ``{"job_configuration": ..., "variables": ...}``.

    A fresh dict on every call, so callers may change it without touching the next caller's.
    """
    path = template_path(name)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"The base job template of work pool {name!r} is missing: {path}. It ships with the "
            "project checkout (deployments/work-pools/); run from a checkout or an editable "
            "install."
        ) from None


def work_pool_create(name: str, description: str | None = None) -> WorkPoolCreate:
    """What ``PrefectClient.create_work_pool`` takes to create pool ``name`` with its template.

    The same pool ``prefect work-pool create NAME --type TYPE --base-job-template FILE`` creates.
    """
    return WorkPoolCreate(
        name=name,
        type=POOLS[name],
        description=description,
        base_job_template=base_job_template(name),
    )
