"""The process the imageops worker starts for a flow run: the checkout's flow, never the API's.

Prefect's own entry (``python -m prefect.engine``) reads the deployment again and runs its pull
steps and imports its entrypoint, which someone may have changed since the worker checked them.
This one checks the flow run again (``app.checked_worker.check_flow_run``), then runs the pull
steps and entrypoint of the checkout's ``deployments/prefect.yaml``. A refusal ends the run Crashed
with the refusal as its message. Details: docs/stack.md#what-a-worker-runs.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import TYPE_CHECKING
from uuid import UUID

from app.checked_worker import Registered, check_flow_run
from tasks.shared.errors import UnregisteredCodeError, error_text

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun


def _checked(flow_run: FlowRun) -> Registered:
    """The registered deployment of ``flow_run`` as the API describes it now (else a refusal)."""
    from prefect.client.orchestration import get_client

    if not flow_run.work_pool_name:
        raise UnregisteredCodeError(
            f"The imageops worker refused flow run {flow_run.name!r}: it names no work pool."
        )
    with get_client(sync_client=True) as client:
        deployment = (
            client.read_deployment(flow_run.deployment_id) if flow_run.deployment_id else None
        )
        work_pool = client.read_work_pool(flow_run.work_pool_name)
    return check_flow_run(flow_run, work_pool, deployment)


def _crash(flow_run_id: UUID, message: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)


def main() -> None:
    """Run the flow run named by ``PREFECT__FLOW_RUN_ID``, as ``prefect.engine`` does, checked."""
    from prefect._internal.control_listener import configure_from_env
    from prefect.deployments.steps.core import run_steps
    from prefect.engine import handle_engine_signals
    from prefect.flow_engine import flow_run_logger, load_flow_run, run_flow
    from prefect.flows import load_flow_from_entrypoint

    flow_run_id = UUID(os.environ["PREFECT__FLOW_RUN_ID"])
    configure_from_env()  # Prefect's cancellation channel, before any flow code (as its engine)
    flow_run = load_flow_run(flow_run_id=flow_run_id)
    try:
        registered = _checked(flow_run)
    except UnregisteredCodeError as exc:
        flow_run_logger(flow_run=flow_run).error(str(exc))
        _crash(flow_run_id, exc.message)
        sys.exit(error_text(exc))
    with handle_engine_signals(flow_run_id):
        asyncio.run(run_steps(registered.pull_steps))  # the checkout's: the project folder
        flow = load_flow_from_entrypoint(registered.entrypoint)
        run_flow(flow, flow_run=flow_run, error_logger=flow_run_logger(flow_run=flow_run))


if __name__ == "__main__":
    main()
