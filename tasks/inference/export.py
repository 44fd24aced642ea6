"""Export to ONNX: ``model.onnx`` beside the weights, proven to answer as the PyTorch model does.

The network is rebuilt from the ModelDirectory (safetensors, nothing unpickled), exported, and
replaces ``model.onnx`` only if ONNX Runtime matches PyTorch on the same batch (within
:data:`PARITY_TOLERANCE` plus :data:`PARITY_RTOL` of each logit, same argmax, two batch sizes).
The file records the sha256 of its weights, so registration can tell a stale ``model.onnx``.
Details: docs/precision.md#onnx-export.

torch, onnx and ONNX Runtime are imported by the functions that use them: scoring imports this
module for the tensor names and :func:`sha256_file` only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from models.atomic import atomic_file
from models.directory import INT8_REPORT, ONNX, ONNX_INT8, WEIGHTS, ModelInfo, load_model_directory
from tasks.data.imagedir import load_rgb, read_manifest
from tasks.data.transform import input_size, transform_for
from tasks.shared.errors import ExportParityError, InvalidModelDirectoryError, NoUsableImagesError
from tasks.shared.file_hash import file_sha256
from tasks.shared.step import step, step_logger, tasks_on_first_use

if TYPE_CHECKING:
    import torch
    from torch import nn

INPUT_NAME = "input"
OUTPUT_NAME = "logits"
PARITY_TOLERANCE = 1e-4
# Float32 rounding grows with the logits: a network whose batch-norm statistics are still wild
# (a few epochs on a few images) answers in the millions, where 1e-4 is below one float step.
PARITY_RTOL = 1e-5
PARITY_BATCH = 8
# The batch is exported at 2, not 1: torch.export specialises a size-1 dimension to a constant.
EXPORT_BATCH = 2
SEED = 0
META_WEIGHTS_SHA256 = "imageops.weights_sha256"
META_CLASSES = "imageops.classes"


@dataclass(frozen=True)
class ExportResult:
    """Where ``model.onnx`` is and how closely it matched PyTorch."""

    path: Path
    max_abs_diff: float
    batch_sizes: tuple[int, ...]  # every batch size ONNX Runtime ran in the parity check
    opset: int


def sha256_file(path: Path) -> str:
    return file_sha256(path)[1]


def parity_batch(info: ModelInfo, sample: Path | None, size: int = PARITY_BATCH) -> torch.Tensor:
    """The batch PyTorch and ONNX Runtime are compared on.

    Real images (spread over the sample's manifest, through the model's inference transform) test
    what scoring will see; without a sample, a seeded normal batch still compares every weight.
    """
    import torch

    side = input_size(info.transform)
    if sample is None:
        generator = torch.Generator().manual_seed(SEED)
        return torch.randn(size, 3, side, side, generator=generator)
    manifest = read_manifest(Path(sample))
    transform = transform_for(info.transform, "inference", Path(sample), manifest.transform)
    count = len(manifest.images)
    picks = np.linspace(0, count - 1, num=min(size, count)).round().astype(int)
    tensors = []
    for index in sorted(set(picks.tolist())):
        try:
            tensors.append(transform(load_rgb(Path(sample) / manifest.images[index].path)))
        except Exception:  # an unreadable sample image just is not compared
            continue
    if len(tensors) < EXPORT_BATCH:
        raise NoUsableImagesError(
            f"The sample {sample} gave {len(tensors)} readable image(s); the parity check needs "
            f"at least {EXPORT_BATCH}.",
            "Pass a larger ImageDirectory as the sample, or none to compare on a random batch.",
        )
    return torch.stack(tensors)


def check_parity(onnx_path: Path, model: nn.Module, batch: torch.Tensor) -> tuple[float, tuple]:
    """Run ``batch`` and a second, smaller batch through PyTorch and ONNX Runtime.

    The second batch size proves the batch axis is really dynamic. Returns the largest absolute
    difference over both and the batch sizes run; raises ExportParityError when the difference
    exceeds :data:`PARITY_TOLERANCE` plus :data:`PARITY_RTOL` of the logit's size (as
    ``numpy.allclose``), or any argmax differs.
    """
    import onnxruntime as ort
    import torch

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(
        str(onnx_path), sess_options=options, providers=["CPUExecutionProvider"]
    )
    # A size that differs from the full batch and from the export batch.
    sizes = (len(batch), 1 if len(batch) != 1 else 3)
    worst, mismatched, beyond = 0.0, 0, False
    for size in sizes:
        inputs = batch[:size] if size <= len(batch) else batch.repeat(size, 1, 1, 1)[:size]
        with torch.no_grad():
            expected = model(inputs).numpy()
        (got,) = session.run([OUTPUT_NAME], {INPUT_NAME: inputs.numpy()})
        if got.shape != expected.shape:
            raise ExportParityError(
                f"{onnx_path} returned logits of shape {got.shape} for a batch of {size}; "
                f"PyTorch returned {expected.shape}.",
                "The batch axis is not dynamic: export again.",
            )
        worst = max(worst, float(np.abs(got - expected).max()))
        beyond |= not np.allclose(got, expected, rtol=PARITY_RTOL, atol=PARITY_TOLERANCE)
        mismatched += int((got.argmax(axis=1) != expected.argmax(axis=1)).sum())
    if beyond or mismatched:
        raise ExportParityError(
            f"{onnx_path} does not match PyTorch: max abs difference {worst:.3g} (tolerance "
            f"{PARITY_TOLERANCE:g} + {PARITY_RTOL:g} x |logit|), {mismatched} of {sum(sizes)} "
            "predicted classes differ.",
            "Export again with another opset; if it persists, report the architecture and opset.",
        )
    return worst, sizes


def export_onnx(
    model_dir: Path, *, sample: Path | None = None, opset: int | None = None
) -> ExportResult:
    """Export the ModelDirectory ``model_dir`` to ``model_dir/model.onnx`` and prove parity.

    ``sample``: an ImageDirectory whose images make the parity batch (default: a seeded random
    batch). ``opset``: the ONNX opset (default: the exporter's recommended one). Raises
    ExportParityError when ONNX Runtime disagrees with PyTorch; ``model.onnx`` is then left as it
    was (written atomically, only after the check passed).
    """
    import onnx
    import torch
    from onnx.external_data_helper import uses_external_data

    model_dir = Path(model_dir)
    model, info = load_model_directory(model_dir)
    batch = parity_batch(info, sample)
    log = step_logger(__name__)

    # The dynamo (torch.export) exporter, not the TorchScript one: TorchScript export is
    # deprecated ("will be removed") and warns on every call. Measured here on 2 CPU cores, dynamo
    # takes about 4-7 s for resnet18 and 17 s for densenet121 (TorchScript: 1.5 s / 3.5 s), a
    # small price next to training, with identical parity (< 1e-6) on both.
    program = torch.onnx.export(
        model,
        (batch[:EXPORT_BATCH],),
        input_names=[INPUT_NAME],
        output_names=[OUTPUT_NAME],
        opset_version=opset,
        dynamo=True,
        dynamic_shapes=({0: torch.export.Dim("batch")},),
        external_data=False,
        verbose=False,
    )
    program.model.metadata_props[META_WEIGHTS_SHA256] = sha256_file(model_dir / WEIGHTS)
    program.model.metadata_props[META_CLASSES] = json.dumps(info.classes)
    used_opset = int(program.model.opset_imports.get("", 0))

    dest = model_dir / ONNX
    with atomic_file(dest) as tmp:
        # One file: weights inline. protobuf caps that at 2 GB, far above the zoo's largest
        # network (wide_resnet101_2, about 500 MB).
        program.save(str(tmp), external_data=False)
        proto = onnx.load(str(tmp), load_external_data=False)
        if any(uses_external_data(t) for t in proto.graph.initializer):
            raise InvalidModelDirectoryError(
                f"The exporter wrote external weight data for {dest}; imageops ships one file.",
                "Report the torch and onnxscript versions.",
            )
        onnx.checker.check_model(proto, full_check=True)
        del proto
        max_diff, sizes = check_parity(tmp, model, batch)
    # An earlier external-data export would leave weights beside the file that nothing reads,
    # and an INT8 model quantized from the old model.onnx would score with the old weights.
    for stale in (f"{ONNX}.data", ONNX_INT8, INT8_REPORT):
        (model_dir / stale).unlink(missing_ok=True)
    log.info("Exported %s (opset %d): max abs difference %.3g", dest, used_opset, max_diff)
    return ExportResult(path=dest, max_abs_diff=max_diff, batch_sizes=sizes, opset=used_opset)


def verify_onnx(model_dir: Path, *, sample: Path | None = None) -> ExportResult:
    """Check an existing ``model.onnx`` against the directory's weights (the same parity gate)."""
    import onnx

    model_dir = Path(model_dir)
    model, info = load_model_directory(model_dir)
    path = model_dir / ONNX
    if not path.is_file():
        raise InvalidModelDirectoryError(
            f"{model_dir} has no {ONNX}.", f"Export it first: `imageops export {model_dir}`."
        )
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    opset = next((o.version for o in proto.opset_import if o.domain == ""), 0)
    del proto
    max_diff, sizes = check_parity(path, model, parity_batch(info, sample))
    return ExportResult(path=path, max_abs_diff=max_diff, batch_sizes=sizes, opset=opset)


def onnx_weights_sha256(onnx_path: Path) -> str | None:
    """The weights sha256 recorded in ``model.onnx`` at export (None for a foreign file)."""
    import onnx

    proto = onnx.load(str(onnx_path), load_external_data=False)
    return {p.key: p.value for p in proto.metadata_props}.get(META_WEIGHTS_SHA256)


__getattr__ = tasks_on_first_use(
    globals(),
    export_task=lambda: step(export_onnx, name="export-onnx"),
)
