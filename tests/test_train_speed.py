"""The fast training path: precision chosen and refused before launch, a bf16 run on CPU, loaders
whose augmentation does not depend on loader processes, and the GPU path (NCCL, fp16 with a
gradient scaler, pinned memory) on machines that have GPUs."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from training_runs import run_train

from models.transform_spec import TransformSpec
from tasks.data.imagedir import read_manifest
from tasks.data.transform import build_transform
from tasks.shared.errors import InvalidParameterError, TrainingDivergedError
from tasks.shared.settings import Settings
from tasks.train.data import LoaderSetup, ManifestImageFolder, training_loader
from tasks.train.launch import TrainResult
from tasks.train.loop import THROUGHPUT_PER_PROCESS, check_weights, to_device
from tasks.train.params import TrainParams
from tasks.train.precision import (
    Amp,
    cpu_bf16_feature,
    cpu_bf16_runs,
    precision_choice,
    resolve_precision,
)
from tasks.train.run_folder import CHECKPOINT

pytest_plugins = ["training_runs"]
# From 64 px a CPU run trains channels-last (and, under auto, in bf16): the fast path.
PRE64 = TransformSpec(resize_size=64, center_crop_size=64, random_horizontal_flip=False)
NO_GPU = "needs a CUDA GPU (runs on GPU machines; this one has none)"
NO_TWO_GPUS = "needs 2 CUDA GPUs for a 2-process NCCL run"


def run_config(result: TrainResult) -> dict:
    return json.loads((result.run_dir / "config.json").read_text())


# --- precision: resolved and refused before anything starts ---------------------------------


def test_fp16_on_cpu_is_refused_before_anything_starts(
    project: Settings, untrained: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    with pytest.raises(InvalidParameterError, match=r"precision = 'fp16' is for CUDA GPUs") as err:
        run_train(project, untrained, digits_split, tmp_path / "out", precision="fp16")
    assert "bf16" in (err.value.hint or "")  # says what to use instead
    assert not project.runs_dir.exists()
    assert not (project.home_dir / "mlflow.db").exists()


def test_auto_precision_on_cpu_follows_the_cpu_flags_never_a_timing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Issue 46: a timed probe chose fp32 on a busy machine and bf16 on a quiet one, two models
    # from one command. Now no clock is read: the decision is what the CPU is, and it says so.
    def no_clock() -> float:
        raise AssertionError("precision auto read a clock")

    monkeypatch.setattr(time, "perf_counter", no_clock)
    monkeypatch.setattr(time, "monotonic", no_clock)
    cpu_bf16_feature.cache_clear()
    cpu_bf16_runs.cache_clear()
    feature = cpu_bf16_feature()
    chosen, why = precision_choice("auto", "cpu", 224)
    if feature is not None and cpu_bf16_runs():
        assert (chosen, why) == ("bf16", f"CPU has {feature}")
    else:
        assert chosen == "fp32" and ("neither AMX nor AVX-512 BF16" in why or feature in why)
    assert precision_choice("auto", "cpu", 32) == (
        "fp32",
        "inputs of 32 px, under 64: float32 is faster there",
    )
    assert resolve_precision("fp32", "cpu", 224) == "fp32"
    with pytest.raises(InvalidParameterError, match="precision = 'fp8'"):
        resolve_precision("fp8", "cpu")


def test_small_inputs_train_in_fp32_on_cpu() -> None:
    # Under 64 px bf16 gains nothing; at 16 px the last stage has 1x1 maps, where the CPU's
    # bf16 weight gradients are unreliable.
    assert resolve_precision("auto", "cpu", 32) == "fp32"
    if cpu_bf16_runs():
        assert resolve_precision("bf16", "cpu", 32) == "bf16"  # asked for: allowed from 32 px
    assert resolve_precision("auto", "cpu", 16) == "fp32"
    with pytest.raises(InvalidParameterError, match=r"at least 32 px; this transform gives 16"):
        resolve_precision("bf16", "cpu", 16)


def test_a_non_finite_weight_stops_training_with_advice() -> None:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    check_weights(model, epoch=1, precision="bf16")  # finite: nothing to say
    with torch.no_grad():
        model[0].weight[0, 0, 0, 0] = math.nan
    with pytest.raises(TrainingDivergedError, match=r"epoch 2 \(precision bf16\): 0.weight"):
        check_weights(model, epoch=2, precision="bf16")


def test_bad_num_workers_is_refused_naming_the_value() -> None:
    with pytest.raises(InvalidParameterError, match=r"num_workers = -1"):
        TrainParams.checked(num_workers=-1)


def test_a_step_keeps_fp32_weights_in_channels_last_and_trains_in_bf16() -> None:
    if not cpu_bf16_runs():
        pytest.skip("bfloat16 autocast does not run on this CPU")
    amp = Amp.for_run("cpu", "bf16", input_size=64)
    assert amp.memory_format == torch.channels_last
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten())
    model = model.to(memory_format=amp.memory_format)
    images = to_device(torch.randn(2, 3, 5, 5), torch.device("cpu"), amp.memory_format)
    assert images.is_contiguous(memory_format=torch.channels_last)
    with amp.autocast():
        out = model(images)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    weight = model[0].weight
    assert weight.dtype == torch.float32 and weight.grad.dtype == torch.float32
    assert weight.is_contiguous(memory_format=torch.channels_last)
    assert not amp.grad_scaler().is_enabled()  # bf16 needs no loss scaling


def test_small_inputs_stay_nchw_on_cpu_and_never_on_gpu() -> None:
    # Under 64 px a CPU step is mostly overhead, where plain NCHW is fastest.
    assert Amp.for_run("cpu", "fp32", input_size=32).memory_format == torch.contiguous_format
    assert Amp.for_run("cpu", "fp32", input_size=224).memory_format == torch.channels_last
    assert Amp.for_run("cuda", "fp16", input_size=32).memory_format == torch.channels_last


@pytest.mark.slow
def test_a_bf16_run_on_cpu_trains(
    project: Settings, untrained: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    if not cpu_bf16_runs():
        pytest.skip("bfloat16 autocast does not run on this CPU")
    result = run_train(
        project, untrained, digits_split, tmp_path / "model", PRE64, precision="bf16"
    )
    assert all(math.isfinite(v) for v in result.metrics.values())
    assert run_config(result)["precision"] == "bf16"
    log = (result.run_dir / "rank_0.log").read_text()
    assert "precision bf16 (asked: bf16), channels-last" in log
    client = MlflowClient(project.tracking_uri)
    assert client.get_run(result.run_id).data.params["resolved_precision"] == "bf16"
    per_process = client.get_metric_history(result.run_id, THROUGHPUT_PER_PROCESS)
    assert sorted(m.step for m in per_process) == [1, 2]
    assert all(m.value > 0 for m in per_process)


# --- loaders: the same images whatever the loader processes ------------------------------------


def batches(dataset: ManifestImageFolder, workers: int, epochs: int) -> list[torch.Tensor]:
    loader, sampler = training_loader(
        dataset,
        batch_size=8,
        seed=3,
        rank=0,
        world_size=1,
        setup=LoaderSetup(torch.device("cpu"), workers),
    )
    seen = []
    for epoch in range(1, epochs + 1):
        sampler.set_epoch(epoch)
        seen.append(torch.cat([images for images, _ in loader]))
    return seen


@pytest.mark.slow  # spawns loader processes: seconds each to import torch
def test_augmentation_does_not_depend_on_loader_processes(
    digits_split: tuple[Path, Path],
) -> None:
    root = digits_split[0]
    spec = TransformSpec(
        resize_size=16, center_crop_size=16, random_rotation=True, random_rotation_degrees=30
    )
    dataset = ManifestImageFolder(root, read_manifest(root), build_transform(spec, "training"))
    # In the training process, and in 2 spawned loader processes that persist across epochs.
    inline = batches(dataset, workers=0, epochs=2)
    spawned = batches(dataset, workers=2, epochs=2)
    assert all(torch.equal(a, b) for a, b in zip(inline, spawned, strict=True))
    assert not torch.equal(inline[0], inline[1])  # each epoch draws new augmentations


# --- the GPU path: runs where there is a GPU, skipped (with the reason) elsewhere --------------


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_one_gpu_run_with_fp16_and_a_gradient_scaler(
    project: Settings, untrained: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    keeping = project.model_copy(update={"keep_checkpoints": True})  # to read the scaler
    result = run_train(
        keeping, untrained, digits_split, tmp_path / "model", device="cuda", precision="fp16"
    )
    assert all(math.isfinite(v) for v in result.metrics.values())
    assert run_config(result)["precision"] == "fp16"
    state = torch.load(result.run_dir / CHECKPOINT, map_location="cpu", weights_only=True)
    assert state["scaler"]["scale"] > 0  # the scaler was active and is checkpointed
    log = (result.run_dir / "rank_0.log").read_text()
    assert "on cuda:0" in log and "per process" in log


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_auto_precision_on_gpu_follows_its_capability() -> None:
    major, _ = min(torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))
    assert resolve_precision("auto", "cuda") == ("bf16" if major >= 8 else "fp16")
    assert Amp("cuda", "fp16").grad_scaler().is_enabled()
    assert not Amp("cuda", "bf16").grad_scaler().is_enabled()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=NO_TWO_GPUS)
def test_two_process_nccl_run(
    project: Settings, untrained: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    result = run_train(
        project, untrained, digits_split, tmp_path / "model", device="cuda", nproc_per_node=2
    )
    assert all(math.isfinite(v) for v in result.metrics.values())
    assert run_config(result)["world_size"] == 2
    for rank in (0, 1):
        assert f"on cuda:{rank}" in (result.run_dir / f"rank_{rank}.log").read_text()
