"""Register the deployments of ``deployments/prefect.yaml`` with a Prefect server, from Python.

The file stays the one description of the deployments; every entry is registered with Prefect's
``RunnerDeployment`` (``--work-pool`` moves them all), keeping its pull step so a worker runs the
code where it is. Details: docs/stack.md#deployments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from uuid import UUID

from models.bounded_parse import read_yaml
from tasks.shared.errors import ImageOpsError, error_text

DEPLOYMENTS_FILE = Path(__file__).resolve().parents[1] / "deployments" / "prefect.yaml"
TRAINING_QUEUE = "training"  # one training at a time per pool: this queue's limit is 1

# Keys of a prefect.yaml deployment this registrar carries over; anything else is refused, so
# an option added to the file is never silently dropped.
_KNOWN_KEYS = {
    "name", "description", "entrypoint", "work_pool", "parameters", "schedules", "triggers",
    "tags", "concurrency_limit", "enforce_parameter_schema",
}  # fmt: skip


class _PullSteps:
    """The file's ``pull`` section as a RunnerDeployment's storage (all it needs of one)."""

    def __init__(self, steps: list[dict[str, Any]]) -> None:
        self.steps = steps
        self.destination = Path.cwd()
        self.pull_interval = None

    def set_base_path(self, path: Path) -> None:
        self.destination = path

    async def pull_code(self) -> None:  # the code is already where the pull step points
        return None

    def to_pull_step(self) -> list[dict[str, Any]]:
        return self.steps


def load_spec(path: Path = DEPLOYMENTS_FILE) -> dict[str, Any]:
    """The parsed prefect.yaml; a broken file is an error naming the file."""
    spec = read_yaml(path, ImageOpsError, "Start from the repository's deployments/prefect.yaml.")
    if not isinstance(spec, dict) or not isinstance(spec.get("deployments"), list):
        raise ImageOpsError(
            f"{path} has no `deployments:` list.",
            "Start from the repository's deployments/prefect.yaml.",
        )
    return spec


def full_names(path: Path = DEPLOYMENTS_FILE) -> list[str]:
    """Every deployment of ``path`` as ``flow/deployment``, the name `prefect deployment run` takes.

    The flow's part is the name its ``@flow`` gives (what the UI shows), read from the entrypoint.
    """
    from prefect.utilities.importtools import import_object

    return [
        f"{import_object(entry['entrypoint']).name}/{entry['name']}"
        for entry in load_spec(path)["deployments"]
    ]


def _schedule(entry: dict[str, Any]) -> Any:
    from prefect.schedules import Cron

    if "cron" not in entry:
        raise ImageOpsError(
            f"Schedule {entry!r}: only cron schedules are registered here.",
            "Write it as `cron: '0 2 * * *'` with an optional timezone, parameters and active.",
        )
    return Cron(
        entry["cron"],
        timezone=entry.get("timezone", "UTC"),
        day_or=entry.get("day_or", True),
        active=entry.get("active", True),
        parameters=entry.get("parameters") or {},
        slug=entry.get("slug"),
    )


def runner_deployment(entry: dict[str, Any], pull: list[dict[str, Any]]) -> Any:
    """One prefect.yaml entry as Prefect's RunnerDeployment (loads the flow from its entrypoint)."""
    from prefect.deployments.runner import RunnerDeployment
    from prefect.events import DeploymentTriggerTypes
    from prefect.flows import load_flow_from_entrypoint
    from pydantic import TypeAdapter

    from tasks.shared.forms import form_schema

    unknown = set(entry) - _KNOWN_KEYS
    if unknown:
        raise ImageOpsError(
            f"Deployment {entry.get('name')!r}: options {sorted(unknown)} are not registered.",
            f"Use only {sorted(_KNOWN_KEYS)}.",
        )
    pool = entry.get("work_pool") or {}
    triggers = TypeAdapter(list[DeploymentTriggerTypes]).validate_python(
        entry.get("triggers") or []
    )
    deployment = RunnerDeployment.from_entrypoint(
        entry["entrypoint"],
        name=entry["name"],
        description=entry.get("description"),
        parameters=entry.get("parameters") or {},
        schedules=[_schedule(s) for s in entry.get("schedules") or []],
        triggers=triggers,
        tags=entry.get("tags") or [],
        concurrency_limit=entry.get("concurrency_limit"),
        enforce_parameter_schema=entry.get("enforce_parameter_schema", True),
        work_pool_name=pool.get("name"),
        work_queue_name=pool.get("work_queue_name"),
        job_variables=pool.get("job_variables") or {},
    )
    deployment.storage = _PullSteps(pull)
    # Prefect titles each form field by its Python name and leaves our descriptions out.
    flow = load_flow_from_entrypoint(entry["entrypoint"])
    deployment._parameter_openapi_schema = form_schema(flow)
    return deployment


def register_deployments(
    path: Path = DEPLOYMENTS_FILE, *, work_pool: str | None = None
) -> dict[str, UUID]:
    """Create or update every deployment in ``path``; returns ``{flow/deployment: id}``.

    ``work_pool`` puts every deployment on that pool instead of the file's. Needs
    PREFECT_API_URL (a server: schedules and triggers do nothing on the ephemeral API) and the
    pools to exist (``imageops serve`` creates ``local``).
    """
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        raise ImageOpsError(
            "Registering deployments needs a Prefect server, and PREFECT_API_URL is not set.",
            "Start one (`imageops serve` does) and export PREFECT_API_URL, or set "
            "IMAGEOPS_PREFECT_API_URL.",
        )
    from flows.saved_settings import register_saved_settings

    spec = load_spec(path)
    pull = spec.get("pull") or []
    register_saved_settings()  # the forms' pickers list blocks of these types
    ids: dict[str, UUID] = {}
    # Entrypoints are module paths of the installed package: no working folder to be in.
    for entry in spec["deployments"]:
        pool = dict(entry.get("work_pool") or {})
        if work_pool:
            pool["name"] = work_pool
        deployment = runner_deployment({**entry, "work_pool": pool}, pull)
        key = f"{deployment.flow_name}/{deployment.name}"
        ids[key] = deployment.apply(work_pool_name=pool.get("name"))
    return ids


def main(argv: list[str] | None = None) -> None:
    """``python -m app.deployments``: register every deployment with the server Prefect uses."""
    import argparse

    from tasks.shared.settings import get_settings

    parser = argparse.ArgumentParser(prog="python -m app.deployments", description=__doc__)
    parser.add_argument("--file", type=Path, default=DEPLOYMENTS_FILE, help="the prefect.yaml")
    parser.add_argument(
        "--work-pool", default=None, help="put every deployment on this pool (default: the file's)"
    )
    parser.add_argument(
        "--list", action="store_true", help="print every deployment's flow/deployment name, only"
    )
    args = parser.parse_args(argv)
    if args.list:  # no server needed: the names `prefect deployment run` takes
        try:
            print("\n".join(full_names(args.file)))
        except ImageOpsError as exc:
            raise SystemExit(error_text(exc)) from None
        return
    get_settings().apply()  # IMAGEOPS_PREFECT_API_URL -> PREFECT_API_URL, before Prefect loads
    try:
        ids = register_deployments(args.file, work_pool=args.work_pool)
    except ImageOpsError as exc:
        raise SystemExit(error_text(exc)) from None
    for name, deployment_id in ids.items():
        print(f"{name}: {deployment_id}")


if __name__ == "__main__":
    main()
