"""Fault injection: the MLflow tracking server crashes during training and stays down for 30 s.

A real ``mlflow server`` (SQLite store, artifacts proxied to a folder) is killed, its whole process
group with SIGKILL, while rank 0 stands stopped (tasks.shared.faults) between epoch 2's checkpoint
and its metrics, and started again on the same port with the same store 30 s later. MLflow's own
client retries are turned off in the launcher (MLFLOW_HTTP_REQUEST_MAX_RETRIES=0), so the run
survives by the training's design, not by the client's retry budget: rank 0 warns and trains on, the
launcher waits for the server, then writes the epochs it missed and ends the run. The undisturbed
reference trains while the server is down.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file
from server_processes import Processes, base_env, free_port, healthy
from training_runs import FAST, run_train

from models.untrained import resnet, write_untrained
from tasks.shared import faults
from tasks.shared.settings import Settings
from tasks.shared.tracking import logged_value
from tasks.train.launch import TrainResult
from tasks.train.loop import LOSS

OUTAGE_S = 30.0  # the figure
SEED = 7  # both runs, disturbed and reference, start from the same draw


def stopped_worker(trace: Path, training: threading.Thread) -> psutil.Process | None:
    """Rank 0's worker once it has stopped itself at epoch 2's end; None if the training ended."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and training.is_alive():
        for reached in faults.reached(trace, "train.epoch_end") if trace.exists() else []:
            if reached["epoch"] == "2":
                worker = psutil.Process(int(reached["pid"]))
                # SIGCONT before the SIGSTOP has landed would be lost: wait until it has.
                if worker.status() == psutil.STATUS_STOPPED:
                    return worker
        time.sleep(0.1)  # the state waited for lasts until the test ends it: no window to miss
    return None


@pytest.mark.slow
def test_a_crashed_mlflow_server_loses_no_record_of_the_training(
    project: Settings,
    digits_split: tuple[Path, Path],
    processes: Processes,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    # Rank 0 stops itself (SIGSTOP) at epoch 2's end, after its checkpoint and before its
    # metrics: epoch 1's are in MLflow, epoch 2's not yet. The server crashes while it stands.
    trace = tmp_path / "trace"
    monkeypatch.setenv(faults.FAULT, "train.epoch_end:rank=0:epoch=2:attempt=0:stop")
    monkeypatch.setenv(faults.TRACE, str(trace))
    caplog.set_level(logging.INFO, logger="tasks.train.mlflow_run")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = [
        str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
        "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
        "--artifacts-destination", str(tmp_path / "mlflow-artifacts"),
    ]  # fmt: skip
    server_env = base_env()
    tracked = Settings(
        project_root=project.project_root, home=tmp_path / "tracked", mlflow_tracking_uri=url
    )
    untrained = write_untrained(resnet("resnet18", pretrained=False), tmp_path / "untrained")
    outcome: dict[str, Any] = {}

    def disturbed() -> None:
        try:
            outcome["result"] = run_train(
                tracked, untrained, digits_split, tmp_path / "disturbed", seed=SEED
            )
        except BaseException as exc:  # re-raised by the test
            outcome["error"] = exc

    training = threading.Thread(target=disturbed, daemon=True)
    first = processes.start("mlflow-server", server, server_env)
    processes.wait("the MLflow server", lambda: healthy(f"{url}/health"))
    client = MlflowClient(url)
    training.start()
    worker = stopped_worker(trace, training)
    assert worker is not None, f"the worker did not stop at epoch 2's end: {outcome}"
    (run_dir,) = tracked.runs_dir.iterdir()
    run_id = run_dir.name
    try:
        logged = sorted(m.step for m in client.get_metric_history(run_id, LOSS))
        processes.crash(first)
        crashed = time.monotonic()
    finally:
        worker.resume()
    monkeypatch.delenv(faults.FAULT)  # the undisturbed reference
    reference = run_train(project, untrained, digits_split, tmp_path / "reference", seed=SEED)
    time.sleep(max(0.0, crashed + OUTAGE_S - time.monotonic()))
    processes.start("mlflow-server-again", server, server_env)
    processes.wait("the restarted MLflow server", lambda: healthy(f"{url}/health"))
    training.join(timeout=300)
    assert not training.is_alive(), "the training did not end after the server came back"
    if "error" in outcome:
        raise outcome["error"]
    result: TrainResult = outcome["result"]

    # The outage hit the training: rank 0 trained on without the server, the launcher waited.
    assert logged == [1], f"epochs logged before the crash: {logged}"
    rank0 = (result.run_dir / "rank_0.log").read_text()
    assert "MLflow did not take the metrics of epoch 2" in rank0
    assert "MLflow did not take the metrics; trying again" in caplog.text
    assert "MLflow took the metrics after" in caplog.text

    # The record is whole: FINISHED, every epoch's metrics once, the parameters, the artifacts.
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    epochs = list(range(1, FAST["epochs"] + 1))
    for name in set(result.history[0]) - {"epoch"}:
        history = client.get_metric_history(run_id, name)
        assert sorted(m.step for m in history) == epochs, name
        assert {m.step: m.value for m in history} == {
            int(h["epoch"]): logged_value(h[name]) for h in result.history
        }, name
    for name in ("best_val_top1", "best_epoch"):
        assert [m.step for m in client.get_metric_history(run_id, name)] == [FAST["epochs"]]
    assert run.data.params["epochs"] == str(FAST["epochs"])
    assert run.data.params["seed"] == str(SEED)
    assert "training_curves.png" in {a.path for a in client.list_artifacts(run_id)}
    logs = {Path(a.path).name for a in client.list_artifacts(run_id, "logs")}
    assert {"rank_0.log", "torchrun.log", "config.json"} <= logs
    copy = Path(client.download_artifacts(run_id, "logs/rank_0.log", str(tmp_path / "dl")))
    assert "MLflow did not take the metrics" in copy.read_text()  # the log of the whole run

    # And it trained what an undisturbed run trains.
    same = [k for k in reference.metrics if "images_per_sec" not in k]
    assert {k: result.metrics[k] for k in same} == {k: reference.metrics[k] for k in same}
    a = load_file(str(result.model_dir / "model.safetensors"))
    b = load_file(str(reference.model_dir / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
