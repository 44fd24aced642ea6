"""A flow run's task runs, read back through Prefect's client for a test's assertions."""

from __future__ import annotations

from typing import Any


def task_runs_of(flow_run_id: object) -> list[Any]:
    """The task runs (Prefect's ``TaskRun``) of ``flow_run_id``, oldest first."""
    from prefect.client.orchestration import get_client  # the caller has a Prefect API up
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    with get_client(sync_client=True) as client:
        return client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
            sort=TaskRunSort.EXPECTED_START_TIME_ASC,
        )
