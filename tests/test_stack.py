"""`imageops serve` brings the stack up for real, and people use it as they would from the UI.

One stack per module (a Prefect server with its scheduler, a worker on the `local` pool, an
MLflow server, the promotion receiver), started as a person starts it: the `imageops serve`
command in its own process. The tests then do what the Prefect UI does, through the same REST
API: read the deployments' forms, press Run with their own parameters, look at upcoming runs.
The last test presses Ctrl-C and checks nothing is left running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from server_processes import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MODEL = "imageops-classifier"


@dataclass
class Served:
    process: subprocess.Popen
    log: Path
    root: Path
    api: str
    mlflow: str

    def report(self) -> str:
        logs = [self.log, *sorted((self.root / ".imageops" / "stack" / "logs").glob("*.log"))]
        return "\n".join(
            f"----- {p.name} -----\n{p.read_text(errors='replace')[-3000:]}"
            for p in logs
            if p.is_file()
        )

    def wait(self, what: str, ready: Callable[[], Any], timeout_s: float = 240.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"imageops serve exited while waiting for {what}\n{self.report()}")
            try:
                if result := ready():
                    return result
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{self.report()}")

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.api}{path}", json=body, timeout=30)

    def deployment(self, name: str) -> dict:
        found = self.post("/deployments/filter", {"deployments": {"name": {"any_": [name]}}})
        (deployment,) = found.json()
        return deployment

    def flow_runs(self, deployment_id: str, states: list[str] | None = None) -> list[dict]:
        query: dict[str, Any] = {"deployment_id": {"any_": [deployment_id]}}
        if states:
            query["state"] = {"type": {"any_": states}}
        body = {"flow_runs": query, "limit": 100, "sort": "EXPECTED_START_TIME_ASC"}
        return self.post("/flow_runs/filter", body).json()


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, digits_split: tuple[Path, Path]
) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("served-project")
    ports = {"prefect": free_port(), "mlflow": free_port(), "receiver": free_port()}
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_", "MLFLOW_", "IMAGEOPS_"))
    }
    env |= {
        "PYTHONPATH": str(ROOT),
        "IMAGEOPS_PROJECT_ROOT": str(root),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        # Prefect's own settings pass through the stack: a scheduler that looks every second
        # (not every minute) and a worker that polls every second (not every 10 s).
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
    }
    log = root / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "serve", "--no-ui",
             "--prefect-port", str(ports["prefect"]), "--mlflow-port", str(ports["mlflow"]),
             "--receiver-port", str(ports["receiver"])],
            cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    served = Served(
        process,
        log,
        root,
        api=f"http://127.0.0.1:{ports['prefect']}/api",
        mlflow=f"http://127.0.0.1:{ports['mlflow']}",
    )
    try:
        served.wait("`imageops serve` to say ready", lambda: "ready" in log.read_text())
        yield served
    finally:
        if process.poll() is None:  # the last test stops it with Ctrl-C; this is for a failure
            # Its services first (listed while they are still its children), then itself.
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()


def test_serve_prints_both_uis_and_binds_to_localhost(served: Served) -> None:
    printed = served.log.read_text()
    assert f"Prefect UI  {served.api.removesuffix('/api')}" in printed
    assert f"MLflow UI   {served.mlflow}" in printed
    listening = {
        c.laddr.ip
        for p in psutil.Process(served.process.pid).children(recursive=True)
        for c in p.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }
    assert listening and listening <= {"127.0.0.1"}, listening


def test_every_deployment_is_registered_with_a_typed_form(served: Served) -> None:
    names = {d["name"] for d in served.post("/deployments/filter", {}).json()}
    assert {"pipeline", "train", "train-node", "tune", "tune-trial", "promote", "score"} <= names

    train = served.deployment("train")
    assert train["enforce_parameter_schema"] is True
    schema = train["parameter_openapi_schema"]
    params = schema["definitions"]["TrainParams"]["properties"]
    assert params["epochs"]["title"] == "Epochs"
    assert params["epochs"]["exclusiveMinimum"] == 0
    assert params["momentum"]["exclusiveMaximum"] == 1
    assert params["learning_rate"]["description"].startswith("Initial SGD learning rate")
    assert schema["properties"]["train_data"]["default"] == "data/digits/train"

    # Everything that trains shares the pool's `training` queue, which runs one at a time.
    for name in ("pipeline", "train", "tune"):
        assert served.deployment(name)["work_queue_name"] == "training", name
    queue = served.post("/work_pools/local/queues/filter", {}).json()
    assert {q["name"]: q["concurrency_limit"] for q in queue}["training"] == 1


def test_the_schedules_create_upcoming_runs(served: Served) -> None:
    pipeline, score = served.deployment("pipeline"), served.deployment("score")
    nightly = served.wait(
        "the scheduler to create pipeline runs",
        lambda: served.flow_runs(pipeline["id"], ["SCHEDULED"]),
        timeout_s=60,
    )
    for run in nightly:
        assert run["expected_start_time"][11:19] == "02:00:00", run["expected_start_time"]
    daily = served.wait(
        "the scheduler to create scoring runs",
        lambda: served.flow_runs(score["id"], ["SCHEDULED"]),
        timeout_s=60,
    )
    for run in daily:
        assert run["expected_start_time"][11:19] == "06:00:00"
        assert run["parameters"]["model"] == f"models:/{MODEL}@champion"
    assert len({run["expected_start_time"][:10] for run in nightly}) == len(nightly)


def test_a_parameter_out_of_range_is_refused_by_the_server(served: Served) -> None:
    train = served.deployment("train")
    before = len(served.flow_runs(train["id"]))
    for bad in ({"params": {"epochs": 0}}, {"params": {"momentum": 1.5}}, {"train_data": 3}):
        answer = served.post(f"/deployments/{train['id']}/create_flow_run", {"parameters": bad})
        assert answer.status_code == 409, answer.text
        assert "Validation failed" in answer.text
    assert len(served.flow_runs(train["id"])) == before  # nothing was created to fail later


def test_run_buttons_with_own_parameters_train_one_at_a_time(
    served: Served, digits_split: tuple[Path, Path]
) -> None:
    """Two presses of Run on the train form; the second is a 2-node job on the work pool."""
    train_dir, val_dir = digits_split
    train = served.deployment("train")
    rates = ["0.02", "0.03"]
    started = []
    for rate in rates:  # two presses of Run, one right after the other
        multi_node = rate == rates[1]
        parameters = {
            "train_data": str(train_dir),
            "val_data": str(val_dir),
            "params": {
                "epochs": 1, "batch_size": 32, "learning_rate": float(rate),
                "nproc_per_node": 1, "print_frequency": 1, "nodes": 2 if multi_node else 1,
            },
            "transform": {"resize_size": 16, "center_crop_size": 16},
            "version_data": False,
            "register_model": not multi_node,
        }  # fmt: skip
        if multi_node:  # each node a flow run of train-node, meeting at one endpoint
            parameters["node_deployment"] = "imageops-train-node/train-node"
            parameters["rdzv_endpoint"] = f"127.0.0.1:{free_port()}"
        answer = served.post(
            f"/deployments/{train['id']}/create_flow_run", {"parameters": parameters}
        )
        assert answer.status_code == 201, answer.text
        started.append(answer.json()["id"])

    def finished() -> list[dict] | None:
        runs = [httpx.get(f"{served.api}/flow_runs/{i}", timeout=10).json() for i in started]
        for run in runs:
            if run["state_type"] in {"FAILED", "CRASHED", "CANCELLED"}:
                pytest.fail(f"run {run['name']} ended {run['state_type']}\n{served.report()}")
        return runs if all(r["state_type"] == "COMPLETED" for r in runs) else None

    runs = served.wait("both training runs to complete", finished, timeout_s=420)
    first, second = sorted(runs, key=lambda r: r["start_time"])
    assert first["end_time"] <= second["start_time"], "two trainings ran at once on one pool"
    assert all(r["name"].startswith("train-resnet18") for r in runs)

    # Each run is in MLflow with the parameters pressed in the form.
    from mlflow.tracking import MlflowClient

    # Both URIs: an earlier test in this process may have left MLflow a global registry URI.
    client = MlflowClient(tracking_uri=served.mlflow, registry_uri=served.mlflow)
    experiment = client.get_experiment_by_name("imageops")
    for rate in rates:
        (found,) = client.search_runs(
            [experiment.experiment_id], f"params.learning_rate = '{rate}'"
        )
        assert found.info.status == "FINISHED"
        assert found.data.params["epochs"] == "1"
        assert found.data.params["input_size"] == "16"
        assert found.data.params["world_size"] == ("2" if rate == rates[1] else "1")
    nodes = served.flow_runs(served.deployment("train-node")["id"], ["COMPLETED"])
    assert sorted(r["name"] for r in nodes) == ["train-node-0-of-2", "train-node-1-of-2"]
    (version,) = client.search_model_versions(f"name = '{MODEL}'")
    assert client.get_model_version_by_alias(MODEL, "challenger").version == version.version


def test_ctrl_c_stops_every_process(served: Served) -> None:
    children = psutil.Process(served.process.pid).children(recursive=True)
    assert len(children) >= 4  # two servers, the receiver, the worker (and their own children)
    served.process.send_signal(signal.SIGINT)
    assert served.process.wait(timeout=60) == 0, served.report()
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, [p.cmdline() for p in alive]
    assert "stopped" in served.log.read_text()
