"""The Prefect work pools imageops runs on, and their base job templates.

The templates are data (``deployments/work-pools/<pool>.json``, what ``prefect work-pool create``
takes), so the CLI, the docs (docs/scale-out.md) and ``imageops serve`` create the same pools:
``local`` (process), ``gpu-docker`` and ``gpu-k8s`` (GPUs and /dev/shm as job variables). No job
variable of any pool decides what a worker runs: the command is the worker's own, and what could
run other code (the process pool's environment and folder, a container's image, privileges, host
mounts, a kubeconfig) is fixed in the template or held to a list (``FIXED``).
Details: docs/stack.md#work-pools.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # Prefect's client takes 1.5 s to import: `imageops team join` asks Ray first
    from prefect.client.schemas.actions import WorkPoolCreate

# pool name -> Prefect worker type (the `--type` of `prefect work-pool create`)
POOLS: dict[str, str] = {
    "local": "process",
    "gpu-docker": "docker",
    "gpu-k8s": "kubernetes",
}

# Variables of each worker's own default template that an imageops pool does not offer, and why:
# through any of them an API caller could run a command of its choosing as the worker's user (or
# in its container). tests/test_work_pools.py checks each stays out.
FIXED: dict[str, dict[str, str]] = {
    "local": {
        "command": "the worker's own `python -m prefect.engine`, nothing else",
        "env": "PYTHONWARNINGS+BROWSER, LD_PRELOAD, PYTHONPATH... run code; flow runs get the "
        "worker's environment (the team join file)",
        "working_dir": "a folder of the caller's choosing; the pull step sets the project root",
    },
    "gpu-docker": {
        "command": "the worker's own command",
        "privileged": "a privileged container owns the host",
        "volumes": "a host mount can replace the code the fixed command runs",
        "registry_credentials": "images come only from the template's list",
    },
    "gpu-k8s": {
        "command": "the worker's own command",
        "cluster_config": "a kubeconfig's `exec` credential plugin runs a command on the worker",
    },
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
    from prefect.client.schemas.actions import WorkPoolCreate

    return WorkPoolCreate(
        name=name,
        type=POOLS[name],
        description=description,
        base_job_template=base_job_template(name),
    )
