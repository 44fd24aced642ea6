"""The train flow and the train task under a real Prefect API: two node agents meeting at a c10d
rendezvous on localhost, a node that never comes, and a Prefect retry that continues the run its
killed first attempt started (real torchrun processes, SIGKILLed; no mocks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from prefect import flow
from safetensors.torch import load_file

from flows.train import train_flow
from models.directory import load_model_directory
from models.transform_spec import TransformSpec
from tasks.shared import faults
from tasks.shared.errors import InvalidParameterError, RendezvousTimeoutError
from tasks.shared.settings import Settings
from tasks.train.checkpoint import CHECKPOINT
from tasks.train.launch import (
    TrainResult,
    local_rendezvous_endpoint,
    open_run,
    train,
    train_task,
)
from tasks.train.loop import METRICS
from tasks.train.params import TrainParams
from tasks.train.request import TrainRequest

pytest_plugins = ["training_runs"]
PRE = TransformSpec(resize_size=16, center_crop_size=16, random_horizontal_flip=False)
# fp32: on this machine's CPU (torch 2.14.1) bf16 autocast's convolution backward returns garbage
# for the 1x1 maps a 16x16 image leaves in resnet18's last stage, so bf16 runs do not repeat.
FAST = {"batch_size": 8, "learning_rate": 0.01, "device": "cpu", "precision": "fp32"}


def request(
    untrained: Path, data: tuple[Path, Path], out: Path, params: TrainParams, **launch: object
) -> TrainRequest:
    """The request of these tests: the digits at 16 px, and how this launch joins the job."""
    train_data, val_data = data
    return TrainRequest.model_validate(
        {"model": untrained, "train_data": train_data, "val_data": val_data, "out": out,
         "params": params, "transform": PRE, **launch}
    )  # fmt: skip


def runs(settings: Settings) -> list:
    client = MlflowClient(settings.tracking_uri)
    experiment = client.get_experiment_by_name(settings.mlflow_experiment)
    return client.search_runs([experiment.experiment_id]) if experiment else []


def artifact_names(settings: Settings, run_id: str, folder: str) -> set[str]:
    client = MlflowClient(settings.tracking_uri)
    return {Path(a.path).name for a in client.list_artifacts(run_id, folder)}


@pytest.mark.slow
def test_two_nodes_on_localhost_train_one_run(
    prefect_api: None,
    project: Settings,
    untrained: Path,
    digits_split: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    params = TrainParams.checked(**FAST, epochs=1, nodes=2, nproc_per_node=1)
    result = train_flow(request(untrained, digits_split, tmp_path / "model", params))

    (run,) = runs(project)  # one run for the job, not one per node or rank
    assert run.info.run_id == result.run_id and run.info.status == "FINISHED"
    client = MlflowClient(project.tracking_uri)
    for name in METRICS:
        assert [m.step for m in client.get_metric_history(result.run_id, name)] == [1], name
    assert run.data.params["world_size"] == "2"
    model, info = load_model_directory(tmp_path / "model")
    assert info.mlflow_run_id == result.run_id
    assert info.train_params["world_size"] == 2
    with torch.no_grad():
        assert model(torch.zeros(1, 3, 16, 16)).shape == (1, 3)
    logs = artifact_names(project, result.run_id, "logs")
    assert {"rank_0.log", "rank_1.log", "torchrun_node_0.log", "torchrun_node_1.log"} <= logs
    assert "rank 1 of 2" in (result.run_dir / "rank_1.log").read_text()


def test_many_nodes_need_a_run_and_an_endpoint(
    project: Settings, untrained: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    params = TrainParams.checked(**FAST, epochs=1, nodes=2)
    out = tmp_path / "model"
    with pytest.raises(InvalidParameterError, match="needs a rendezvous endpoint"):
        train(request(untrained, digits_split, out, params, run_id="x"), project)
    with pytest.raises(InvalidParameterError, match=r"rdzv_endpoint = 'nohost'"):
        request(untrained, digits_split, out, params, run_id="x", rdzv_endpoint="nohost")
    with pytest.raises(InvalidParameterError, match="needs the id of the job's MLflow run"):
        train(request(untrained, digits_split, out, params, rdzv_endpoint="127.0.0.1:1"), project)
    with pytest.raises(InvalidParameterError, match=r"node_rank = 2, expected 0 to 1"):
        request(untrained, digits_split, out, params, node_rank=2)
    assert not project.runs_dir.exists()


@pytest.mark.slow
def test_a_node_that_never_comes_ends_in_a_rendezvous_timeout(
    project: Settings, untrained: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    params = TrainParams.checked(**FAST, epochs=1, nodes=2)
    job = request(untrained, digits_split, tmp_path / "model", params)
    run_id = open_run(job, project)
    endpoint = local_rendezvous_endpoint()
    node = {"run_id": run_id, "node_rank": 0, "rdzv_endpoint": endpoint, "rdzv_timeout_s": 3}
    with pytest.raises(RendezvousTimeoutError) as err:  # node 1's agent is never started
        train(job.model_copy(update=node), project)
    message = str(err.value)
    assert f"at {endpoint} timed out after 3 s: 1 of 2 nodes arrived" in message
    assert "missing: 1" in message and "rdzv_timeout_s" in message
    assert not err.value.retryable  # waiting again cannot bring the missing node
    (run,) = runs(project)
    assert run.info.status == "FAILED"
    assert "torchrun_node_0.log" in artifact_names(project, run_id, "logs")
    # An unfinished run with no checkpoint has nothing to resume: asking again opens a new run.
    assert open_run(job, project) != run_id


@pytest.mark.slow
def test_a_prefect_retry_continues_the_run_of_the_killed_attempt(
    prefect_api: None,
    project: Settings,
    untrained: Path,
    digits_split: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    params = TrainParams.checked(**FAST, epochs=2, seed=7)
    reference = train(request(untrained, digits_split, tmp_path / "reference", params), project)
    quick = train_task.with_options(retry_delay_seconds=0, retry_jitter_factor=None)

    @flow(name="train-with-retries")
    def train_once() -> TrainResult:
        return quick(request(untrained, digits_split, tmp_path / "model", params))

    # Right after epoch 1's checkpoint the worker SIGKILLs torchrun, then itself: the machine dying
    # (torchrun, which would restart its worker, goes first). Only the retry can go on.
    trace = tmp_path / "trace"
    monkeypatch.setenv(faults.FAULT, "train.epoch_end:epoch=1:kill_parent")
    monkeypatch.setenv(faults.TRACE, str(trace))
    result = train_once()

    # The first attempt's worker died at epoch 1's end; another process (the retry) trained
    # epoch 2 and only that.
    ended = [(e["pid"], e["epoch"]) for e in faults.reached(trace, "train.epoch_end")]
    assert [epoch for _, epoch in ended] == ["1", "2"] and ended[0][0] != ended[1][0]
    assert {r.info.run_id for r in runs(project)} == {reference.run_id, result.run_id}
    log = (result.run_dir / "rank_0.log").read_text()
    # Two torchruns (the Prefect task's two attempts), not a torchrun restarting its worker.
    assert log.count("attempt 0: rank 0 of 1") == 2
    assert "resumed from the checkpoint after epoch 1" in log  # epoch 1 was not trained again
    client = MlflowClient(project.tracking_uri)
    assert client.get_run(result.run_id).info.status == "FINISHED"
    for name in METRICS:  # every epoch once: none trained twice, none lost
        steps = sorted(m.step for m in client.get_metric_history(result.run_id, name))
        assert steps == [1, 2], name
    same = [k for k in reference.metrics if "images_per_sec" not in k]
    assert {k: result.metrics[k] for k in same} == {k: reference.metrics[k] for k in same}
    load = {"map_location": "cpu", "weights_only": True}
    pairs = {  # the best epoch's weights (the model) and the last epoch's (the checkpoint)
        "model": [load_file(str(r.model_dir / "model.safetensors")) for r in (reference, result)],
        "last": [torch.load(r.run_dir / CHECKPOINT, **load)["model"] for r in (reference, result)],
    }
    for name, (a, b) in pairs.items():
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    # A FINISHED run is never reused: the same request again is a new training run.
    again = open_run(request(untrained, digits_split, tmp_path / "model", params), project)
    assert again not in {reference.run_id, result.run_id}
