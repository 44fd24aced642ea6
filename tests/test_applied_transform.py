"""Apply Image Transformation -> Train PyTorch Model -> Score Image Model, in the Azure order.

The output of Apply carries the transform it applied (its manifest's ``transform``): training and
scoring use that spec, run only the steps not yet applied, and refuse a different one instead of
resizing finished images again.
"""

from __future__ import annotations

from pathlib import Path

import mlflow
import pandas as pd
import pytest
import torch
from projects import imageops

from models.directory import read_model_info
from models.untrained import resnet, write_untrained
from tasks.data.imagedir import load_rgb, read_manifest
from tasks.data.split import split
from tasks.data.transform import (
    apply_transformation,
    build_transform,
    init_transformation,
    input_size,
    read_transformation,
    transform_for,
)
from tasks.inference.export import export_onnx
from tasks.inference.score import score
from tasks.shared.errors import InvalidTransformationDirectoryError
from tasks.shared.settings import Settings
from tasks.train.launch import open_run, train
from tasks.train.recipes import resolve_transform
from tasks.train.request import TrainRequest

# 16x16 digits become 20x20 network inputs: resize to 24, center crop 20; no flip for digits.
SPEC = {"resize_size": 24, "center_crop_size": 20, "random_horizontal_flip": False}


@pytest.fixture
def prepared(tmp_path: Path, digits_raw: Path) -> tuple[Path, Path, Path]:
    """(transform, train, val): convert, apply (inference mode), split, as the Azure order goes."""
    from tasks.data.convert import convert

    transform = init_transformation(tmp_path / "transform", SPEC)
    convert(digits_raw, tmp_path / "images")
    apply_transformation(transform, tmp_path / "images", tmp_path / "applied")
    split(tmp_path / "applied", tmp_path / "train", tmp_path / "val", fraction=0.8, seed=1)
    return transform, tmp_path / "train", tmp_path / "val"


def test_apply_records_its_transform_and_split_keeps_it(prepared: tuple[Path, Path, Path]) -> None:
    transform, train_dir, val_dir = prepared
    spec = read_transformation(transform)
    for root in (train_dir, val_dir):
        applied = read_manifest(root).transform
        assert applied is not None and applied.spec == spec and applied.mode == "inference"
        assert {(e.width, e.height) for e in read_manifest(root).images} == {(20, 20)}


def test_prepared_images_reach_the_network_exactly_as_raw_ones_do(
    prepared: tuple[Path, Path, Path], digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    """No second resize: a prepared image's tensor equals the raw image's full transform."""
    transform, _, _ = prepared
    spec = read_transformation(transform)
    raw_val = digits_split[1]
    out = tmp_path / "val-prepared"
    manifest = apply_transformation(transform, raw_val, out)
    raw_pipeline = transform_for(spec, "inference", raw_val, None)
    prepared_pipeline = transform_for(spec, "inference", out, manifest.transform)
    for entry, source in zip(manifest.images, read_manifest(raw_val).images, strict=True):
        expected = raw_pipeline(load_rgb(raw_val / source.path))
        assert torch.equal(prepared_pipeline(load_rgb(out / entry.path)), expected)
    # training adds only the random steps: none are on here, so training sees the same tensors
    training = build_transform(spec, "training", prepared="inference")
    assert torch.equal(training(load_rgb(out / entry.path)), expected)


def test_train_uses_the_transform_the_data_was_prepared_with(
    project: Settings, prepared: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """The user's path: `imageops train` with no --transform on Apply's output."""
    transform, train_dir, val_dir = prepared
    untrained = write_untrained(resnet("resnet18", pretrained=False), tmp_path / "untrained")
    result = imageops(
        "train", str(untrained), str(train_dir), str(val_dir), str(tmp_path / "model"),
        "--epochs", "1", "--batch-size", "8", "--device", "cpu", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "transform: the one the data was prepared with (20x20 images)" in result.stdout
    info = read_model_info(tmp_path / "model")
    # the data's spec, with the default recipe's (modern) values where it left fields empty:
    # a random resized crop at the data's input size, which scoring does not see
    assert info.transform == resolve_transform(read_transformation(transform), "modern")
    assert info.transform.random_resized_crop and input_size(info.transform) == 20

    # Score Image Model on the prepared validation split equals scoring the raw images.
    export_onnx(tmp_path / "model", sample=val_dir)
    on_prepared = pd.read_csv(score(tmp_path / "model", val_dir, tmp_path / "a.csv", threads=1))
    split(tmp_path / "images", tmp_path / "raw-train", tmp_path / "raw-val", fraction=0.8, seed=1)
    on_raw = pd.read_csv(score(tmp_path / "model", tmp_path / "raw-val", tmp_path / "b.csv"))
    assert on_prepared["Scoring Error"].isna().all()
    assert len(on_prepared) == len(on_raw) == len(read_manifest(val_dir).images)
    probabilities = [c for c in on_raw.columns if c.startswith("Scored Probabilities_")]
    pd.testing.assert_frame_equal(
        on_prepared[["path", *probabilities]], on_raw[["path", *probabilities]], atol=1e-6
    )


def test_a_transform_that_disagrees_with_the_data_is_refused(
    project: Settings, prepared: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    _, train_dir, val_dir = prepared
    untrained = write_untrained(resnet("resnet18", pretrained=False), tmp_path / "untrained")
    other = init_transformation(tmp_path / "other", {**SPEC, "center_crop_size": 16})
    with pytest.raises(InvalidTransformationDirectoryError, match="center_crop_size 20 vs 16"):
        train(TrainRequest(model=untrained, train_data=train_dir, val_data=val_dir,
                           out=tmp_path / "model", params={"epochs": 1}, transform=other),
              project)  # fmt: skip
    assert not project.runs_dir.exists()  # refused before any run or process


def test_validation_data_with_a_training_draw_is_refused(
    project: Settings, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    transform = init_transformation(tmp_path / "t", SPEC)
    train_dir, val_dir = digits_split
    apply_transformation(transform, val_dir, tmp_path / "val", mode="training")
    untrained = write_untrained(resnet("resnet18", pretrained=False), tmp_path / "untrained")
    with pytest.raises(InvalidTransformationDirectoryError, match="prepared in training mode"):
        train(TrainRequest(model=untrained, train_data=train_dir, val_data=tmp_path / "val",
                           out=tmp_path / "model", params={"epochs": 1}), project)  # fmt: skip


def test_apply_refuses_images_that_were_already_transformed(
    prepared: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    transform, train_dir, _ = prepared
    with pytest.raises(InvalidTransformationDirectoryError, match="already went through"):
        apply_transformation(transform, train_dir, tmp_path / "twice")


def test_raw_data_without_a_transform_gets_the_azure_defaults(
    project: Settings, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    """Not the demo's 32 px: the demo default belongs to the demo."""
    untrained = write_untrained(resnet("resnet18", pretrained=False), tmp_path / "untrained")
    run_id = open_run(TrainRequest(model=untrained, train_data=digits_split[0],
                                   val_data=digits_split[1], out=tmp_path / "model",
                                   params={"epochs": 1}), project)  # fmt: skip
    params = mlflow.MlflowClient(project.tracking_uri).get_run(run_id).data.params
    assert params["input_size"] == "224"
    assert params["transform.resize_size"] == "256"
    # the default recipe's random resized crop, recorded as it resolved: at the input size
    rrc = [params[f"transform.random_resized_crop{k}"] for k in ("", "_size", "_scale")]
    assert (params["recipe"], rrc) == ("modern", ["True", "224", "0.5"])


def test_tuning_takes_the_prepared_datas_transform(
    prepared: tuple[Path, Path, Path], digits_split: tuple[Path, Path]
) -> None:
    from flows.config import DEMO_TRANSFORM
    from flows.tune import study_transform

    transform, train_dir, val_dir = prepared
    spec = read_transformation(transform)
    assert study_transform(None, train_dir, val_dir) == spec
    assert study_transform(None, *digits_split) == DEMO_TRANSFORM  # the example study's digits
    assert study_transform(spec, *digits_split) == spec
