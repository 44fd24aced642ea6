"""The process the imageops worker starts for a flow run: the checkout's flow, never the API's.

Prefect's own entry (``python -m prefect.engine``) reads the deployment again and runs its pull
steps and imports its entrypoint, which someone may have changed since the worker checked them.
This one checks the flow run again (``app.checked_worker.check_flow_run``), then runs the pull
steps and entrypoint of the checkout's ``deployments/prefect.yaml``. A refusal ends the run Crashed
with the refusal as its message. Details: docs/stack.md#what-a-worker-runs.

A flow run outlives the worker that started it (SIGKILLed, its machine's services restarted); but
Prefect hears a cancellation through that worker only (its observer, then a signal to this
process), and a new worker leaves a run it did not start alone: ``prefect flow-run cancel`` left
such a run Cancelling for ever. Once its worker is gone, this process watches its own flow run
and cancels itself as that worker would have (:func:`_cancel_once_orphaned`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
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


# How often the process checks that its worker still lives (a system call), and, once it does
# not, how often it reads its flow run's state from the API.
ORPHAN_CHECK_S = 1.0
STATE_CHECK_S = 2.0


def _cancel_once_orphaned(flow_run_id: UUID, worker_pid: int) -> threading.Thread:
    """A daemon thread: once this process's worker ``worker_pid`` is gone (another process is
    its parent), it reads the flow run's state every STATE_CHECK_S, and when someone asks for
    a cancellation (Cancelling), cancels this run as the worker would have: Prefect's cancel
    intent, then SIGTERM to itself. The engine then stops the flow (a training stops its
    processes and ends its MLflow run KILLED) and, with no worker to do it, ends it Cancelled.
    """

    def watch() -> None:
        from prefect.client.orchestration import get_client

        while os.getppid() == worker_pid:
            time.sleep(ORPHAN_CHECK_S)
        with get_client(sync_client=True) as client:
            while True:
                time.sleep(STATE_CHECK_S)
                try:
                    state = client.read_flow_run(flow_run_id).state
                except Exception:  # the API restarting: ask again
                    continue
                if state is None:
                    continue
                if state.is_final():
                    return
                if state.is_cancelling() and _cancel_itself():
                    return

    thread = threading.Thread(target=watch, daemon=True, name="cancel-without-worker")
    thread.start()
    return thread


def _cancel_itself() -> bool:
    """Prefect's cancellation of this flow run, from inside: True once delivered (False while
    the flow is not running yet, or any more: Prefect's signal handler is not in place)."""
    from prefect._internal import control_listener
    from prefect.utilities.engine import commit_control_intent_and_ack

    # The worker that would have set Cancelled is gone: the engine does it (and runs the hooks).
    os.environ["PREFECT__ENABLE_CANCELLATION_AND_CRASHED_HOOKS"] = "true"
    return commit_control_intent_and_ack(
        commit_intent=lambda: control_listener._set_intent("cancel"),
        clear_intent=control_listener.clear_intent,
        send_ack=lambda: None,  # no worker to tell
        trigger_cancel=lambda: os.kill(os.getpid(), signal.SIGTERM),
    )


def main() -> None:
    """Run the flow run named by ``PREFECT__FLOW_RUN_ID``, as ``prefect.engine`` does, checked."""
    from prefect._internal.control_listener import configure_from_env
    from prefect.deployments.steps.core import run_steps
    from prefect.engine import handle_engine_signals
    from prefect.flow_engine import flow_run_logger, load_flow_run, run_flow
    from prefect.flows import load_flow_from_entrypoint

    flow_run_id = UUID(os.environ["PREFECT__FLOW_RUN_ID"])
    worker_pid = os.getppid()
    configure_from_env()  # Prefect's cancellation channel, before any flow code (as its engine)
    flow_run = load_flow_run(flow_run_id=flow_run_id)
    try:
        registered = _checked(flow_run)
    except UnregisteredCodeError as exc:
        flow_run_logger(flow_run=flow_run).error(str(exc))
        _crash(flow_run_id, exc.message)
        sys.exit(error_text(exc))
    _cancel_once_orphaned(flow_run_id, worker_pid)
    with handle_engine_signals(flow_run_id):
        asyncio.run(run_steps(registered.pull_steps))  # the checkout's: the project folder
        flow = load_flow_from_entrypoint(registered.entrypoint)
        run_flow(flow, flow_run=flow_run, error_logger=flow_run_logger(flow_run=flow_run))


if __name__ == "__main__":
    main()
