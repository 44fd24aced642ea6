"""Prefect in a test's own process: a flow run's task runs read back, another API pointed at, a
project's Prefect database read with no server up."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tasks.shared.servers import wait_until


def task_runs_of(flow_run_id: object, want: int, timeout_s: float = 60.0) -> list[Any]:
    """The task runs (Prefect's ``TaskRun``) of ``flow_run_id``, oldest first, once ``want`` of
    them have ended.

    Prefect 3 records task runs from the events their engine emits, after the flow run has
    returned: read at once, a busy API has not recorded them all yet.
    """
    from prefect.client.orchestration import get_client  # the caller has a Prefect API up
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    runs: list[Any] = []
    with get_client(sync_client=True) as client:

        def ended() -> bool:
            runs[:] = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                sort=TaskRunSort.EXPECTED_START_TIME_ASC,
            )
            return sum(r.state is not None and r.state.is_final() for r in runs) >= want

        wait_until(ended, timeout_s, interval_s=0.5)
    return runs


def artifacts_of(flow_run_id: object, key: str) -> list[Any]:
    """The artifacts (Prefect's ``Artifact``) named ``key`` that ``flow_run_id`` published."""
    from prefect.client.orchestration import get_client  # the caller has a Prefect API up
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        this_run = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        return [a for a in client.read_artifacts(flow_run_filter=this_run) if a.key == key]


@contextmanager
def prefect_api_at(api: str, auth: str | None = None) -> Iterator[None]:
    """Prefect in this process pointed at ``api``, its event and log workers rebound to it.

    Both workers are process-wide and read PREFECT_API_URL once, when they start: without a
    drain, a flow run on another server sends its task runs' events to the server used before
    it, and every test after it sends them to this one once it has stopped, a minute's timeout
    an event (seen in CI: task runs missing, then a session teardown that never ended).
    """
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    drain_prefect_workers()
    updates: dict[Any, str] = {PREFECT_API_URL: api}
    if auth:  # the login of an API behind an auth string (`imageops serve`'s, a team's)
        updates[PREFECT_API_AUTH_STRING] = auth
    with temporary_settings(updates=updates):
        try:
            yield
        finally:
            drain_prefect_workers()


def drain_prefect_workers(timeout_s: float = 60.0) -> None:
    """Send what Prefect's event and log workers hold and stop them; the next use starts them
    anew on the API configured then."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    EventsWorker.drain_all(timeout=timeout_s)
    APILogWorker.drain_all(timeout=timeout_s)


@contextmanager
def info_logs_sent() -> Iterator[None]:
    """Prefect's run loggers at INFO inside the block (the suite sets WARNING: the runs' INFO lines
    would be neither shown nor sent to the API), as they are for a user."""
    import logging

    loggers = [logging.getLogger(name) for name in ("prefect.flow_runs", "prefect.task_runs")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def log_messages_of(
    flow_run_id: object, complete: Callable[[list[str]], bool], timeout_s: float = 60.0
) -> list[str]:
    """The log messages of ``flow_run_id`` (its task runs' too), once ``complete`` says they
    are all there: the logs sent are drained first, and the API may store them a moment later
    (a busy 2-core CI machine read them before they were in)."""
    from prefect.client.orchestration import get_client  # the caller has a Prefect API up
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    drain_prefect_workers()
    messages: list[str] = []
    with get_client(sync_client=True) as client:

        def stored() -> bool:
            of_the_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
            messages.clear()
            while True:  # the API answers 200 logs at most
                page = client.read_logs(log_filter=of_the_run, limit=200, offset=len(messages))
                messages.extend(log.message for log in page)
                if len(page) < 200:
                    return complete(messages)

        wait_until(stored, timeout_s, interval_s=0.5)
    return messages


def prefect_rows(database: Path, query: str) -> list[tuple]:
    """``query``'s rows from a project's Prefect SQLite database (``<home>/prefect/prefect.db``),
    read while no API server is up."""
    with contextlib.closing(sqlite3.connect(database)) as db:
        return db.execute(query).fetchall()
