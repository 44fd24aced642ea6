"""Export to ONNX: one self-contained file, a dynamic batch axis, and a parity gate that bites."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from model_helpers import copy_model, make_model_dir
from onnx import numpy_helper
from safetensors.torch import load_file, save_file

from models.directory import ONNX, WEIGHTS, load_model_directory
from tasks.data.imagedir import load_rgb, read_manifest
from tasks.data.transform import build_transform
from tasks.inference.export import (
    META_WEIGHTS_SHA256,
    PARITY_RTOL,
    PARITY_TOLERANCE,
    export_onnx,
    onnx_weights_sha256,
    parity_batch,
    sha256_file,
    verify_onnx,
)
from tasks.shared.errors import ExportParityError

pytest_plugins = ["model_fixtures"]


def test_export_writes_one_checked_file_with_named_dynamic_io(exported_model: Path) -> None:
    files = sorted(p.name for p in exported_model.iterdir())
    assert files == ["model.json", "model.onnx", "model.safetensors"]  # no .data, no temp left
    proto = onnx.load(str(exported_model / ONNX))
    onnx.checker.check_model(proto, full_check=True)
    (inp,) = proto.graph.input
    (out,) = proto.graph.output
    assert inp.name == "input"
    assert out.name == "logits"
    batch_dim = inp.type.tensor_type.shape.dim[0]
    assert batch_dim.dim_param and not batch_dim.dim_value  # symbolic, not a fixed size
    assert onnx_weights_sha256(exported_model / ONNX) == sha256_file(
        exported_model / "model.safetensors"
    )


@pytest.mark.parametrize("batch", [1, 5])
def test_dynamic_batch_matches_pytorch_on_real_images(
    exported_model: Path, digits_split: tuple[Path, Path], batch: int
) -> None:
    model, info = load_model_directory(exported_model)
    val = digits_split[1]
    transform = build_transform(info.transform, "inference")
    entries = read_manifest(val).images[:batch]
    x = torch.stack([transform(load_rgb(val / e.path)) for e in entries])
    session = ort.InferenceSession(str(exported_model / ONNX), providers=["CPUExecutionProvider"])
    (got,) = session.run(["logits"], {"input": x.numpy()})
    with torch.no_grad():
        expected = model(x).numpy()
    assert got.shape == (batch, 3)
    assert np.abs(got - expected).max() <= PARITY_TOLERANCE
    assert (got.argmax(1) == expected.argmax(1)).all()


def test_parity_numbers_reported_within_tolerance(exported_model: Path) -> None:
    result = verify_onnx(exported_model)  # the random-batch path of the same gate
    assert 0.0 <= result.max_abs_diff <= PARITY_TOLERANCE
    assert len(set(result.batch_sizes)) == 2 and 1 in result.batch_sizes
    assert result.opset >= 18
    assert result.path == exported_model / ONNX


def test_tampered_weights_fail_the_parity_gate(exported_model: Path, tmp_path: Path) -> None:
    model_dir = copy_model(exported_model, tmp_path / "tampered")
    proto = onnx.load(str(model_dir / ONNX))
    # The classifier's bias: shifting one logit by 0.5 is far outside the tolerance.
    (bias,) = [t for t in proto.graph.initializer if t.name == "fc.bias"]
    shifted = numpy_helper.to_array(bias).copy()
    shifted[0] += 0.5
    bias.CopyFrom(numpy_helper.from_array(shifted, name=bias.name))
    onnx.save(proto, str(model_dir / ONNX))

    with pytest.raises(ExportParityError) as caught:
        verify_onnx(model_dir)
    message = str(caught.value)
    assert "max abs difference 0.5" in message
    assert "predicted classes differ" in message


def test_logits_in_the_millions_pass_by_the_rounding_their_size_allows(
    tmp_path: Path, model_classes: list[str]
) -> None:
    """A few epochs on a few tiny images can leave batch-norm statistics that make logits of
    about 1e7 (seen after `imageops run` at 8 px): float32 rounding alone then differs by more
    than 1e-4, which an absolute tolerance took for a broken export."""
    model_dir = make_model_dir(tmp_path / "m", model_classes, seed=1)
    weights = load_file(model_dir / WEIGHTS)
    for name in ("fc.weight", "fc.bias"):
        weights[name] = weights[name] * 1e7
    save_file(weights, model_dir / WEIGHTS)
    model, info = load_model_directory(model_dir)
    with torch.no_grad():
        assert model(parity_batch(info, None)).abs().max() > 1e5

    result = export_onnx(model_dir)

    assert PARITY_TOLERANCE < result.max_abs_diff <= PARITY_TOLERANCE + PARITY_RTOL * 1e8


def test_reexport_replaces_the_file_and_records_the_new_weights(
    tmp_path: Path, model_classes: list[str]
) -> None:
    model_dir = make_model_dir(tmp_path / "m", model_classes, seed=1)
    (model_dir / "model.onnx.data").write_bytes(b"stale external data from an old export")
    result = export_onnx(model_dir, opset=18)
    assert result.opset == 18
    assert result.max_abs_diff <= PARITY_TOLERANCE
    assert not (model_dir / "model.onnx.data").exists()
    proto = onnx.load(str(model_dir / ONNX))
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta[META_WEIGHTS_SHA256] == sha256_file(model_dir / "model.safetensors")
    assert not [p for p in model_dir.iterdir() if p.name.startswith(".")]
