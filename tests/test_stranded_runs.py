"""MLflow runs stranded by their ended flow runs: every page of them ended, on a real Prefect API
and a real MLflow (SQLite); the stacks' loop keeps its clients (issue 44)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
from mlflow.tracking import MlflowClient
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings
from prefect.states import Crashed, Pending

from app import stranded_runs
from tasks.shared import servers
from tasks.shared.settings import Settings
from tasks.train.mlflow_run import FLOW_RUN_TAG


@flow(name="stranded-runs-test")
def _nothing() -> None:
    """A flow to make flow runs of; never run."""


@pytest.mark.usefixtures("prefect_api")
def test_stranded_runs_beyond_one_page_are_all_ended(
    project: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five crashed flow runs' MLflow runs with a page of two: all five end FAILED in one call;
    the run of a flow run still going stays RUNNING."""
    monkeypatch.setattr(stranded_runs, "PAGE", 2)
    mlflow = MlflowClient(tracking_uri=project.tracking_uri, registry_uri=project.registry_uri)
    experiment = mlflow.create_experiment("stranded")
    with get_client(sync_client=True) as prefect:
        crashed = [prefect.create_flow_run(_nothing, state=Crashed()) for _ in range(5)]
        going_on = prefect.create_flow_run(_nothing, state=Pending())
        runs = [
            mlflow.create_run(experiment, tags={FLOW_RUN_TAG: str(f.id)}).info.run_id
            for f in crashed
        ]
        alive = mlflow.create_run(experiment, tags={FLOW_RUN_TAG: str(going_on.id)})
        done = stranded_runs.end_stranded_runs(mlflow, prefect)
    assert len(done) == 5, done
    assert {mlflow.get_run(r).info.status for r in runs} == {"FAILED"}
    assert mlflow.get_run(alive.info.run_id).info.status == "RUNNING"


@pytest.mark.usefixtures("prefect_api")
def test_the_loop_keeps_its_clients_and_makes_new_ones_after_a_failure(
    project: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stacks' loop: its first clients reach a Prefect API that does not answer (a server
    restarting): said once; the next round's new clients end the stranded run, and the rounds
    after that keep them."""
    monkeypatch.setattr(stranded_runs, "RECONCILE_EVERY_S", 0.05)
    mlflow = MlflowClient(tracking_uri=project.tracking_uri, registry_uri=project.registry_uri)
    experiment = mlflow.create_experiment("stranded-loop")
    with get_client(sync_client=True) as prefect:
        crashed = prefect.create_flow_run(_nothing, state=Crashed())
    run = mlflow.create_run(experiment, tags={FLOW_RUN_TAG: str(crashed.id)}).info.run_id
    opened: list[str] = []
    # The loop's thread gets the API by name, as the stacks' loop does: a thread reads Prefect's
    # process-global settings, which an earlier test of the same worker can have pointed at a
    # server since stopped (CI, twice: every round's clients refused).
    here = {PREFECT_API_URL: PREFECT_API_URL.value()}

    @contextlib.contextmanager
    def clients() -> Iterator[tuple[object, object]]:
        down = not opened  # the first: a port nothing listens on
        opened.append("down" if down else "up")
        nowhere = {  # no retries: a refused connection at once
            PREFECT_API_URL: f"http://127.0.0.1:{servers.free_port()}/api",
            PREFECT_CLIENT_MAX_RETRIES: 0,
        }
        with (
            temporary_settings(updates=nowhere if down else here),
            get_client(sync_client=True) as prefect,
        ):
            yield mlflow, prefect

    said: list[str] = []
    stop = threading.Event()
    thread = stranded_runs.keep_ending_stranded_runs(clients, said.append, stop)
    try:
        # 60 s: in a full run the session's Prefect test server (SQLite) is shared with the
        # other tests of this worker, and its answers can take a client's retries.
        ended = servers.wait_until(lambda: mlflow.get_run(run).info.status == "FAILED", 60, 0.1)
        assert ended, f"not ended; clients made: {opened}; said: {said}"
        time.sleep(0.5)  # several more rounds
    finally:
        stop.set()
        thread.join(10)
    assert opened == ["down", "up"], opened
    assert len(said) == 2 and said[0].startswith("could not check for stranded MLflow runs")
    assert said[1] == f"MLflow run {run} ended FAILED: its flow run {crashed.id} is CRASHED"
