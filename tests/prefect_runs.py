"""A flow run's task runs, read back from the Prefect API for a test's assertions."""

from __future__ import annotations

from typing import Any


def task_runs_of(flow_run_id: object) -> list[dict[str, Any]]:
    """The task runs of ``flow_run_id``, oldest first, as the API's JSON."""
    from prefect.client.orchestration import get_client  # the caller has a Prefect API up

    with get_client(sync_client=True) as client:
        # Prefect 3.8's read_task_runs sends null limit/sort, which its server rejects (422).
        response = client.request(
            "POST",
            "/task_runs/filter",
            json={
                "flow_runs": {"id": {"any_": [str(flow_run_id)]}},
                "sort": "EXPECTED_START_TIME_ASC",
                "limit": 50,
            },
        )
    return response.json()
