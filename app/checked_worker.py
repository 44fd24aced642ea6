"""The Prefect worker imageops starts: it runs a flow run only as the project registered it.

Whoever may call the Prefect API can change a work pool's base job template or register a
deployment with pull steps or an entrypoint of its own, and Prefect's workers run what those say.
Before anything of a flow run starts, this worker compares its work pool's template, its
deployment (entrypoint, pull steps, job variables) and its job variables with the files of the
worker's own checkout (``deployments/prefect.yaml``, ``deployments/work-pools/<pool>.json``) and
refuses on any difference: the run ends Crashed, the message naming what differs. On the process
pool the run's process is then ``app.flow_run_entry``, which checks again and runs the checkout's
pull steps and entrypoint, never the API's. Details: docs/stack.md#what-a-worker-runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from prefect.workers.process import ProcessJobConfiguration, ProcessWorker, ProcessWorkerResult
from pydantic import PrivateAttr

from app.deployments import DEPLOYMENTS_FILE, load_spec
from app.flow_heartbeats import heartbeat_environment
from app.work_pools import POOLS, base_job_template, template_path
from models.bounded_parse import shown
from tasks.shared.errors import UnregisteredCodeError

if TYPE_CHECKING:
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.objects import FlowRun, WorkPool
    from prefect.client.schemas.responses import DeploymentResponse
    from prefect.flows import Flow
    from prefect.workers.base import BaseWorker


@dataclass(frozen=True)
class Registered:
    """A deployment as ``deployments/prefect.yaml`` registers it: what a worker may run."""

    name: str
    entrypoint: str
    pull_steps: list[dict[str, Any]]
    job_variables: dict[str, Any]
    enforce_parameter_schema: bool


def registered_deployments(path: Path = DEPLOYMENTS_FILE) -> dict[str, Registered]:
    """Every deployment of the checkout's prefect.yaml, by deployment name."""
    spec = load_spec(path)
    pull = spec.get("pull") or []
    return {
        entry["name"]: Registered(
            name=entry["name"],
            entrypoint=entry["entrypoint"],
            pull_steps=pull,
            job_variables=(entry.get("work_pool") or {}).get("job_variables") or {},
            enforce_parameter_schema=entry.get("enforce_parameter_schema", True),
        )
        for entry in spec["deployments"]
    }


def _differences(shipped: Any, found: Any, where: str = "") -> list[str]:
    """Dotted paths where ``found`` differs from ``shipped`` (JSON-like values)."""
    if isinstance(shipped, dict) and isinstance(found, dict):
        paths: list[str] = []
        for key in sorted(set(shipped) | set(found), key=str):
            at = f"{where}.{key}" if where else str(key)
            if key not in shipped:
                paths.append(f"{at} added ({shown(found[key])})")
            elif key not in found:
                paths.append(f"{at} removed")
            else:
                paths += _differences(shipped[key], found[key], at)
        return paths
    return [] if shipped == found else [f"{where or 'the whole'} changed to {shown(found)}"]


def template_changes(pool: str, template: dict[str, Any]) -> list[str]:
    """How work pool ``pool``'s base job template differs from the checkout's file."""
    if pool not in POOLS:
        return [f"work pool {pool!r} is none of the project's ({', '.join(POOLS)})"]
    paths = _differences(base_job_template(pool), template)
    if not paths:
        return []
    shown = "; ".join(paths[:5]) + (f"; and {len(paths) - 5} more" if len(paths) > 5 else "")
    return [
        f"the base job template of work pool {pool!r} differs from "
        f"deployments/work-pools/{template_path(pool).name}: {shown}"
    ]


def deployment_changes(
    deployment: DeploymentResponse | None, registered: dict[str, Registered]
) -> tuple[Registered | None, list[str]]:
    """The registered deployment a flow run's deployment claims to be, and how it differs."""
    if deployment is None:
        return None, ["the flow run has no deployment (only the project's deployments run here)"]
    entry = registered.get(deployment.name)
    if entry is None:
        return None, [
            f"deployment {shown(deployment.name)} (entrypoint {shown(deployment.entrypoint)}, "
            f"pull steps {shown(deployment.pull_steps)}) is not one of deployments/prefect.yaml "
            f"({', '.join(registered)})"
        ]
    named = f"deployment {deployment.name!r}:"
    changes = []
    if deployment.entrypoint != entry.entrypoint:
        changes.append(
            f"{named} its entrypoint is {shown(deployment.entrypoint)}, not {entry.entrypoint!r}"
        )
    if (deployment.pull_steps or []) != entry.pull_steps:
        changes.append(f"{named} its pull steps are {shown(deployment.pull_steps)}")
    if (deployment.job_variables or {}) != entry.job_variables:
        changes.append(f"{named} its job variables are {shown(deployment.job_variables)}")
    if deployment.enforce_parameter_schema != entry.enforce_parameter_schema:
        changes.append(f"{named} its parameters are not checked against its schema")
    return entry, changes


def flow_run_changes(flow_run: FlowRun, pool: str) -> list[str]:
    """Job variables of the flow run that the checkout's template of ``pool`` does not offer."""
    offered = set(base_job_template(pool)["variables"]["properties"]) if pool in POOLS else set()
    extra = sorted(set(flow_run.job_variables or {}) - offered)
    return [f"the flow run's job variables {shown(extra)} are not offered"] if extra else []


def check_flow_run(
    flow_run: FlowRun, work_pool: WorkPool, deployment: DeploymentResponse | None
) -> Registered:
    """The registered deployment to run for ``flow_run``, or a refusal naming every change."""
    entry, changes = deployment_changes(deployment, registered_deployments())
    changes = [
        *template_changes(work_pool.name, work_pool.base_job_template),
        *changes,
        *flow_run_changes(flow_run, work_pool.name),
    ]
    if changes or entry is None:
        raise UnregisteredCodeError(
            f"The imageops worker refused flow run {flow_run.name!r}: "
            + "; ".join(changes)
            + ". Nothing of it ran.",
            "Someone with the Prefect API's credential changed what the project registered: "
            "restart `imageops serve` (or `imageops team server`), which registers the pools "
            "and deployments again; if you do not know who, rotate the credential first (see "
            "docs/stack.md, 'What a credential holder can do').",
        )
    return entry


class CheckedResolve:
    """A job configuration (mixin) whose flow runs are checked before they are configured."""

    @classmethod
    async def resolve_for_flow_run(
        cls,
        flow_run: FlowRun,
        *,
        client: PrefectClient,
        work_pool: WorkPool,
        worker_name: str,
        worker_id: Any = None,
        deployment: DeploymentResponse | None = None,
    ) -> Any:
        """Check, then configure from the very pool copy and deployment that were checked."""
        if deployment is None and flow_run.deployment_id:
            deployment = await client.read_deployment(flow_run.deployment_id)
        registered = check_flow_run(flow_run, work_pool, deployment)
        configuration = await super().resolve_for_flow_run(  # type: ignore[misc]
            flow_run,
            client=client,
            work_pool=work_pool,
            worker_name=worker_name,
            worker_id=worker_id,
            deployment=deployment,
        )
        if hasattr(configuration, "_registered"):
            configuration._registered = registered
        return configuration


class CheckedProcessJobConfiguration(CheckedResolve, ProcessJobConfiguration):
    _registered: Registered | None = PrivateAttr(default=None)


def _dispatch_key(cls: type) -> str:
    # Not Prefect's own key (the pool type): no warning that Prefect's class is overridden.
    return f"imageops-{cls.type}"  # type: ignore[attr-defined]


class CheckedProcessWorker(ProcessWorker):
    """Prefect's process worker, checked (:class:`CheckedResolve`), starting its own entry."""

    job_configuration = CheckedProcessJobConfiguration
    __dispatch_key__ = classmethod(_dispatch_key)

    async def run(
        self,
        flow_run: FlowRun,
        configuration: ProcessJobConfiguration,
        task_status: anyio.abc.TaskStatus[int] | None = None,
    ) -> ProcessWorkerResult:
        """``ProcessWorker.run`` with ``python -m app.flow_run_entry`` as the run's process, in the
        project folder; Prefect's crash and cancellation hooks get the checkout's flow too (its
        own would load the deployment's code into this worker)."""
        from prefect.flows import load_flow_from_entrypoint
        from prefect.runner._flow_run_executor import FlowRunExecutorContext
        from prefect.runner._starter_engine import EngineCommandStarter
        from prefect.utilities.processutils import command_to_string, get_sys_executable

        status = task_status if task_status is not None else anyio.TASK_STATUS_IGNORED
        registered = getattr(configuration, "_registered", None)
        if registered is None:  # resolve_for_flow_run checks every run: never reached
            raise UnregisteredCodeError(f"Flow run {flow_run.name!r} was not checked.")

        async def checkout_flow(_: FlowRun) -> Flow:
            return load_flow_from_entrypoint(registered.entrypoint)

        async with FlowRunExecutorContext() as ctx:
            starter = EngineCommandStarter(
                command=command_to_string([get_sys_executable(), "-m", "app.flow_run_entry"]),
                cwd=os.environ.get("IMAGEOPS_PROJECT_ROOT") or os.getcwd(),
                env=configuration.env,
                stream_output=configuration.stream_output,
                control_channel=ctx.control_channel,
            )
            executor = ctx.create_executor(
                flow_run, starter, resolve_flow=checkout_flow, propose_submitting=False
            )
            execution = None

            async def execute(
                *, task_status: anyio.abc.TaskStatus[Any] = anyio.TASK_STATUS_IGNORED
            ) -> None:
                nonlocal execution
                execution = await executor.submit(task_status=task_status)

            async with anyio.create_task_group() as group:
                handle = await group.start(execute)
                if handle.pid is None:
                    raise RuntimeError("Flow run process has no PID")
                status.started(handle.pid)
        if execution is None or execution.status_code is None:
            raise RuntimeError("Failed to start flow run process.")
        return ProcessWorkerResult(
            status_code=execution.status_code, identifier=str(execution.handle.pid)
        )


def checked_worker_class(pool: str) -> type[BaseWorker]:
    """The worker for ``pool`` (one of ``POOLS``): Prefect's class of its type, checked."""
    if pool == "local":
        return CheckedProcessWorker
    from prefect.workers.base import BaseWorker

    base = BaseWorker.get_worker_class_from_type(POOLS[pool])
    if base is None:
        raise UnregisteredCodeError(
            f"No Prefect worker of type {POOLS[pool]!r} is installed for work pool {pool!r}.",
            "Install the project's lock (`make install`: prefect-docker, prefect-kubernetes).",
        )
    configuration = type(
        f"Checked{base.job_configuration.__name__}", (CheckedResolve, base.job_configuration), {}
    )
    return type(
        f"Checked{base.__name__}",
        (base,),
        {"job_configuration": configuration, "__dispatch_key__": classmethod(_dispatch_key)},
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m app.checked_worker --pool POOL [--name NAME]``: what the stacks start (and
    what to start instead of ``prefect worker start``)."""
    from prefect.settings import PREFECT_WORKER_HEARTBEAT_SECONDS
    from prefect.utilities.processutils import setup_signal_handlers_worker

    parser = argparse.ArgumentParser(prog="python -m app.checked_worker", description=__doc__)
    parser.add_argument("--pool", choices=list(POOLS), required=True)
    parser.add_argument("--name", help="the worker's name (default: imageops-POOL-HOSTNAME)")
    args = parser.parse_args(argv)
    for name, value in heartbeat_environment().items():  # its flow runs' environment
        os.environ.setdefault(name, value)
    worker_class = checked_worker_class(args.pool)
    setup_signal_handlers_worker(os.getpid(), f"the imageops {args.pool} worker", print)
    worker = worker_class(
        work_pool_name=args.pool,
        name=args.name or f"imageops-{args.pool}-{socket.gethostname()}",
        create_pool_if_not_found=False,  # the stack created it, with the project's template
        heartbeat_interval_seconds=int(PREFECT_WORKER_HEARTBEAT_SECONDS.value()),
    )
    asyncio.run(worker.start(printer=print))


if __name__ == "__main__":
    main()
