"""MLflow runs stranded by their flow run: RUNNING while it has ended, ended the same way.

A training ends its MLflow run itself, however it stops, unless its process is killed outright
(SIGKILL, a machine lost): the flow run then ends Crashed (its worker sees the process die, or the
server's zombie automation misses its heartbeats, see :mod:`app.lost_flow_runs`) and the MLflow
run would stay RUNNING for ever. Each training run started by a flow run carries that flow run's
id (``tasks.train.mlflow_run.FLOW_RUN_TAG``); the stacks that own a Prefect server (``imageops
serve``, ``imageops team server``) call :func:`end_stranded_runs` every RECONCILE_EVERY_S:
Crashed or Failed flow run, FAILED MLflow run; Cancelled, KILLED.
Details: docs/training.md#failures-and-cancellation.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from tasks.train.mlflow_run import FLOW_RUN_TAG

RECONCILE_EVERY_S = 10.0
# The MLflow status a stranded run gets, by the state type its flow run ended in.
ENDS = {"CRASHED": "FAILED", "FAILED": "FAILED", "CANCELLED": "KILLED"}
ENDED_BY_TAG = "imageops.ended_by"
PAGE = 200  # runs per MLflow search and flow runs per Prefect read (the API's default limit)


def end_stranded_runs(mlflow: Any, prefect: Any) -> list[str]:
    """End every RUNNING MLflow run whose flow run has ended; what was done, one line each.

    ``mlflow`` is an MlflowClient, ``prefect`` a sync Prefect client of the same team's servers.
    A flow run this Prefect server does not know (another server's) leaves its run alone.
    """
    from mlflow.entities import ViewType
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    experiments = [e.experiment_id for e in mlflow.search_experiments(view_type=ViewType.ALL)]
    if not experiments:
        return []
    by_flow_run: dict[str, list[str]] = {}
    token = None
    while True:  # every page: a team with more stranded runs than one page still gets them all
        runs = mlflow.search_runs(
            experiments,
            filter_string=f"attributes.status = 'RUNNING' and tags.`{FLOW_RUN_TAG}` LIKE '%'",
            max_results=PAGE,
            page_token=token,
        )
        for run in runs:
            by_flow_run.setdefault(run.data.tags[FLOW_RUN_TAG], []).append(run.info.run_id)
        token = runs.token
        if not token:
            break
    ids = [i for i in (_uuid(value) for value in by_flow_run) if i is not None]
    flow_runs = [  # the API answers at most PAGE flow runs per call
        flow_run
        for start in range(0, len(ids), PAGE)
        for flow_run in prefect.read_flow_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids[start : start + PAGE])),
            limit=PAGE,
        )
    ]
    done = []
    for flow_run in flow_runs:
        state = flow_run.state.type.value if flow_run.state is not None else None
        status = ENDS.get(state or "")
        if status is None:
            continue
        for run_id in by_flow_run.get(str(flow_run.id), []):
            mlflow.set_tag(run_id, ENDED_BY_TAG, f"flow run {flow_run.id} ended {state}")
            mlflow.set_terminated(run_id, status)
            done.append(
                f"MLflow run {run_id} ended {status}: its flow run {flow_run.id} is {state}"
            )
    return done


def _uuid(value: str) -> Any:
    from uuid import UUID

    try:
        return UUID(value)
    except ValueError:
        return None


def keep_ending_stranded_runs(
    clients: Callable[[], AbstractContextManager[tuple[Any, Any]]],
    say: Callable[[str], None],
    stop: threading.Event,
) -> threading.Thread:
    """A daemon thread that calls :func:`end_stranded_runs` every RECONCILE_EVERY_S until
    ``stop``; ``clients`` gives its clients (MLflow, Prefect), ``say`` tells what it ended.

    The clients are kept from round to round and made anew after a failure. A server that does
    not answer now is asked again next time (said once per kind of failure, not every round: the
    stack's own loop says when a service is down).
    """

    def loop() -> None:
        failing: str | None = None  # the kind of the failure said last, None while it works
        with contextlib.ExitStack() as held:
            pair: tuple[Any, Any] | None = None
            while not stop.wait(RECONCILE_EVERY_S):
                try:
                    if pair is None:
                        pair = held.enter_context(clients())
                    for line in end_stranded_runs(*pair):
                        say(line)
                    failing = None
                except Exception as exc:  # a server restarting: the next round asks again
                    held.close()
                    pair = None
                    if failing != type(exc).__name__:
                        say(f"could not check for stranded MLflow runs ({type(exc).__name__}: "
                            f"{exc})")  # fmt: skip
                    failing = type(exc).__name__

    thread = threading.Thread(target=loop, daemon=True, name="stranded-runs")
    thread.start()
    return thread
