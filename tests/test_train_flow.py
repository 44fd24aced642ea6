"""The train task under a real Prefect API: a Prefect retry that continues the run its killed
first attempt started (real torchrun processes, SIGKILLed; no mocks), and what a job of many nodes
needs before it starts (the cluster itself: tests/test_cluster*.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from prefect import flow
from safetensors.torch import load_file

from models.transform_spec import TransformSpec
from tasks.shared import faults
from tasks.shared.errors import InvalidParameterError
from tasks.shared.settings import Settings
from tasks.train.launch import TrainResult, open_run, train, train_task
from tasks.train.loop import METRICS
from tasks.train.params import TrainParams
from tasks.train.request import TrainRequest
from tasks.train.run_folder import CHECKPOINT

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


def test_many_nodes_need_a_cluster(
    project: Settings, untrained: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    with pytest.raises(InvalidParameterError, match="nodes = 2 needs a Ray cluster"):
        TrainParams.checked(**FAST, epochs=1, nodes=2)
    params = TrainParams.checked(**FAST, epochs=1, nodes=2, cluster="10.0.0.5:6379")
    assert params.world_size == 2
    # A cluster job's nodes share servers only: a tracking store on this machine is refused
    # before anything is versioned, connected to or started.
    with pytest.raises(InvalidParameterError, match="needs an MLflow server every node reaches"):
        train(request(untrained, digits_split, tmp_path / "model", params), project)
    assert not project.runs_dir.exists() and not (project.project_root / ".dvc").exists()


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
    # Both runs keep their last checkpoint once FINISHED, to compare the last epochs' weights.
    monkeypatch.setenv("IMAGEOPS_KEEP_CHECKPOINTS", "true")
    keeping = project.model_copy(update={"keep_checkpoints": True})
    reference = train(request(untrained, digits_split, tmp_path / "reference", params), keeping)
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


def test_a_flow_run_outside_the_project_names_the_root_it_looked_in(
    prefect_api: None, project: Settings
) -> None:
    """A worker started in another folder: the error says where it looked and what to set."""
    from flows.train import train_model_flow

    with pytest.raises(InvalidParameterError) as err:
        train_model_flow(train_data="data/digits/train", val_data="data/digits/val")
    message = str(err.value)
    assert f"does not exist under the project root {project.project_root}" in message
    assert "IMAGEOPS_PROJECT_ROOT" in message and "imageops team join" in message
