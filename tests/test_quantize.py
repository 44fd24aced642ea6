"""Static INT8 quantization on real digits: a checked QDQ model, an honest top-1 gate, scoring.

The model is the tests' seeded resnet18 (16 px) with its classifier fitted in closed form (ridge
regression on the network's features of the training digits), so top-1 means something (100% on
the validation digits) without a training run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pandas as pd
import pytest
import torch
from model_helpers import copy_model, make_model_dir
from onnx import numpy_helper

from models.directory import (
    INT8_REPORT,
    ONNX,
    ONNX_INT8,
    load_model_directory,
    save_model_directory,
)
from tasks.data.convert import convert
from tasks.data.imagedir import ImageEntry, Manifest, load_rgb, read_manifest
from tasks.data.transform import build_transform
from tasks.inference.export import export_onnx
from tasks.inference.quantize import META_QUANTIZATION, calibration_entries, quantize
from tasks.inference.score import score
from tasks.shared.errors import (
    InvalidModelDirectoryError,
    InvalidParameterError,
    NotLabeledDatasetError,
    QuantizationAccuracyError,
)

pytest_plugins = ["model_fixtures"]


def _features(model: torch.nn.Module, root: Path, transform) -> tuple[torch.Tensor, torch.Tensor]:
    manifest = read_manifest(root)
    x = torch.stack([transform(load_rgb(root / e.path)) for e in manifest.images])
    head, model.fc = model.fc, torch.nn.Identity()
    with torch.no_grad():
        features = model(x)
    model.fc = head
    return features, torch.tensor([e.label for e in manifest.images])


@pytest.fixture(scope="module")
def fitted_model(
    tmp_path_factory: pytest.TempPathFactory,
    digits_split: tuple[Path, Path],
    model_classes: list[str],
) -> Path:
    """An exported ModelDirectory whose head is fitted to the training digits. Copy to modify."""
    train, val = digits_split
    model_dir = make_model_dir(tmp_path_factory.mktemp("quantize") / "fitted", model_classes)
    model, info = load_model_directory(model_dir)
    features, labels = _features(model, train, build_transform(info.transform, "inference"))
    design = torch.cat([features, torch.ones(len(features), 1)], dim=1)
    targets = torch.nn.functional.one_hot(labels, len(model_classes)).float() * 2 - 1
    solution = torch.linalg.solve(
        design.T @ design + torch.eye(design.shape[1]), design.T @ targets
    )
    model.fc.weight.data = solution[:-1].T.contiguous()
    model.fc.bias.data = solution[-1].contiguous()
    save_model_directory(model_dir, model, info)
    export_onnx(model_dir, sample=val)
    return model_dir


@pytest.fixture(scope="module")
def quantized(
    fitted_model: Path, digits_split: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
):
    """(model directory with model.int8.onnx, QuantizeResult). Do not modify: copy it first."""
    model_dir = copy_model(fitted_model, tmp_path_factory.mktemp("quantized") / "model")
    # A loose gate: these tests are about the files and the figures; the gate has its own test.
    return model_dir, quantize(model_dir, *digits_split, max_top1_drop=100.0, batch_size=16)


def _top1(table: Path) -> float:
    frame = pd.read_csv(table, dtype={"category": str, "Scored Labels": str})
    return float((frame["category"] == frame["Scored Labels"]).mean())


def test_quantize_writes_a_checked_qdq_model_and_its_report(
    quantized: tuple[Path, object], digits_split: tuple[Path, Path]
) -> None:
    model_dir, result = quantized
    assert result.path == model_dir / ONNX_INT8
    proto = onnx.load(str(result.path))
    onnx.checker.check_model(proto, full_check=True)
    ops = {node.op_type for node in proto.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "Conv"} <= ops
    int8_weights = [t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.INT8]
    assert len(int8_weights) >= 20  # every convolution's weights, stored as int8
    # Same input and output names as model.onnx, so scoring feeds it unchanged.
    assert [i.name for i in proto.graph.input] == ["input"]
    assert [o.name for o in proto.graph.output] == ["logits"]
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta[META_QUANTIZATION])["calibration_images"] == 72
    assert result.path.stat().st_size < (model_dir / ONNX).stat().st_size / 3

    train, val = digits_split
    assert result.calibration_images == len(read_manifest(train).images) == 72  # all, < 256
    assert result.validation_images == len(read_manifest(val).images)
    assert result.fp32_top1 == 1.0  # the fitted head separates the validation digits
    report = json.loads((model_dir / INT8_REPORT).read_text())
    assert report["fp32_top1"] == result.fp32_top1
    assert report["int8_top1"] == result.int8_top1
    assert report["top1_drop_points"] == result.top1_drop
    assert report["calibration"] == str(train.resolve())
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(
        ["model.json", "model.safetensors", ONNX, ONNX_INT8, INT8_REPORT]
    )  # no temporary file left


def test_reported_drop_matches_scoring_with_each_model(
    quantized: tuple[Path, object], digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    model_dir, result = quantized
    val = digits_split[1]
    fp32 = score(model_dir, val, tmp_path / "fp32.csv", batch_size=5)
    int8 = score(model_dir, val, tmp_path / "int8.csv", batch_size=5, quantized=True)

    table = pd.read_csv(int8, dtype={"path": str, "category": str, "Scored Labels": str})
    probs = [f"Scored Probabilities_{c}" for c in ("0", "1", "2")]
    assert list(table.columns) == list(pd.read_csv(fp32, nrows=0).columns)  # the same table
    assert {"id", "path", "category", *probs, "Scored Labels"} <= set(table.columns)
    assert len(table) == result.validation_images
    np.testing.assert_allclose(table[probs].sum(axis=1), 1.0, atol=1e-9)

    assert _top1(fp32) == pytest.approx(result.fp32_top1)
    assert _top1(int8) == pytest.approx(result.int8_top1)
    drop = 100 * (_top1(fp32) - _top1(int8))
    assert result.top1_drop == pytest.approx(drop, abs=1e-6)
    assert abs(result.top1_drop) <= 100 / result.validation_images  # at most one digit changes


def _logits_offset(model_dir: Path, scale: float, offset: float) -> None:
    """Scale the classifier and add one constant to every logit, in model.onnx.

    The fp32 answers do not change (softmax and argmax ignore a common offset), but int8 does:
    the logits' 8-bit scale is spent on the offset and the small differences between classes
    round to the same value, so nearly every image gets class 0.
    """
    proto = onnx.load(str(model_dir / ONNX))
    for tensor in proto.graph.initializer:
        if tensor.name in ("fc.weight", "fc.bias"):
            value = numpy_helper.to_array(tensor) * scale
            if tensor.name == "fc.bias":
                value = value + offset
            tensor.CopyFrom(numpy_helper.from_array(value.astype(np.float32), name=tensor.name))
    onnx.save(proto, str(model_dir / ONNX))


def test_a_drop_above_the_limit_is_refused_and_leaves_no_int8_model(
    fitted_model: Path, quantized: tuple[Path, object], digits_split: tuple[Path, Path], tmp_path
) -> None:
    model_dir = copy_model(fitted_model, tmp_path / "fragile")
    _logits_offset(model_dir, scale=0.1, offset=1000.0)
    # An INT8 model from an earlier, accepted run must not survive a refused one.
    shutil.copyfile(quantized[0] / ONNX_INT8, model_dir / ONNX_INT8)
    shutil.copyfile(quantized[0] / INT8_REPORT, model_dir / INT8_REPORT)

    with pytest.raises(QuantizationAccuracyError) as caught:
        quantize(model_dir, *digits_split, max_top1_drop=10.0)

    message = str(caught.value)
    assert "100.00% fp32 ->" in message
    assert "more than max_top1_drop = 10" in message
    assert "calibration_images" in caught.value.hint and "fp32" in caught.value.hint
    assert sorted(p.name for p in model_dir.iterdir()) == [
        "model.json",
        "model.onnx",
        "model.safetensors",
    ]
    with pytest.raises(InvalidModelDirectoryError, match=r"no model\.int8\.onnx") as missing:
        score(model_dir, digits_split[1], tmp_path / "s.csv", quantized=True)
    assert f"`imageops quantize {model_dir} TRAIN VAL`" in missing.value.hint


def test_bad_input_is_refused_before_any_work(
    fitted_model: Path, digits_split: tuple[Path, Path], digits_raw: Path, tmp_path: Path
) -> None:
    train, val = digits_split
    with pytest.raises(InvalidParameterError, match=r"max_top1_drop .* got -0.1"):
        quantize(fitted_model, train, val, max_top1_drop=-0.1)
    with pytest.raises(InvalidParameterError, match="calibration_images must be >= 1, got 0"):
        quantize(fitted_model, train, val, calibration_images=0)

    unlabeled = tmp_path / "unlabeled"
    convert(next(digits_raw.iterdir()), unlabeled)  # one class folder alone: a flat folder
    with pytest.raises(NotLabeledDatasetError, match="validation"):
        quantize(fitted_model, train, unlabeled)

    no_onnx = tmp_path / "no-onnx"
    shutil.copytree(fitted_model, no_onnx, ignore=shutil.ignore_patterns("*.onnx"))
    with pytest.raises(InvalidModelDirectoryError, match=r"no model\.onnx to quantize"):
        quantize(no_onnx, train, val)
    assert not list(fitted_model.glob("*int8*"))


def test_calibration_images_are_spread_over_the_classes_without_randomness() -> None:
    entries = [
        ImageEntry(path=f"{label}/{i:02d}.png", label=label, sha256="0", width=8, height=8)
        for label, count in ((0, 40), (1, 40), (2, 20))
        for i in range(count)
    ]
    shuffled = entries[::-1]  # the order in the manifest does not matter
    manifest = Manifest(labeled=True, classes=["0", "1", "2"], images=shuffled)
    picked = calibration_entries(manifest, 10)
    assert [e.label for e in picked].count(2) == 2  # 20% of the images, 20% of the picks
    assert [e.label for e in picked].count(0) == 4
    assert picked == calibration_entries(manifest, 10)
    assert len(calibration_entries(manifest, 500)) == 100
