"""Static INT8 quantization: ``model.int8.onnx`` beside ``model.onnx``, kept if accurate enough.

Static, not dynamic: it runs every convolution in int8 (QDQ, per-channel weights), calibrated on
training images through the model's inference transform. Both models score the validation set
and an INT8 model losing more than ``max_top1_drop`` top-1 points is refused and removed, so
scoring never picks up one the gate did not pass. Details: docs/precision.md#int8-quantization.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quant_pre_process,
    quantize_static,
)

from models.atomic import atomic_file, write_json
from models.directory import INT8_REPORT, ONNX, ONNX_INT8, ModelInfo, read_model_info
from tasks.data.imagedir import ImageEntry, Manifest, load_rgb, read_manifest, require_labeled
from tasks.data.transform import applied_to, transform_for
from tasks.inference.export import INPUT_NAME, OUTPUT_NAME
from tasks.inference.score import inference_session
from tasks.shared.errors import (
    InvalidDatasetError,
    InvalidModelDirectoryError,
    InvalidParameterError,
    NoUsableImagesError,
    QuantizationAccuracyError,
)
from tasks.shared.step import step, step_logger, tasks_on_first_use

REPORT_FORMAT = "imageops.Int8Report"
META_QUANTIZATION = "imageops.quantization"


@dataclass(frozen=True)
class QuantizeResult:
    """What INT8 costs: top-1 of both models on the validation images, and where the file is.

    ``fp32_top1`` and ``int8_top1`` are fractions (0..1), as ``val/top1`` is everywhere else;
    ``top1_drop`` is ``fp32_top1 - int8_top1`` in percentage points (negative when INT8 does
    better). ``agreement``: the fraction of validation images both models put in the same class.
    """

    path: Path
    fp32_top1: float
    int8_top1: float
    top1_drop: float
    agreement: float
    calibration_images: int
    validation_images: int


def calibration_entries(manifest: Manifest, count: int) -> list[ImageEntry]:
    """``count`` images of ``manifest``, evenly spaced over its images ordered by class and path.

    Even spacing over a class-ordered list is a stratified sample (each class in proportion to
    its size) that needs no random seed: the same directory always calibrates the same way.
    """
    ordered = sorted(manifest.images, key=lambda e: (-1 if e.label is None else e.label, e.path))
    if count >= len(ordered):
        return ordered
    picks = np.linspace(0, len(ordered) - 1, num=count).round().astype(int)
    return [ordered[i] for i in sorted(set(picks.tolist()))]


class _CalibrationReader(CalibrationDataReader):
    """Feeds the calibration images to ORT's calibrator, one batch of tensors at a time."""

    def __init__(
        self, root: Path, entries: list[ImageEntry], info: ModelInfo, batch_size: int
    ) -> None:
        self._batches = self._read(root, entries, info, batch_size)
        self.used = 0

    def _read(
        self, root: Path, entries: list[ImageEntry], info: ModelInfo, batch_size: int
    ) -> Iterator[dict[str, np.ndarray]]:
        transform = transform_for(info.transform, "inference", root, applied_to(root))
        log = step_logger(__name__)
        for start in range(0, len(entries), batch_size):
            tensors = []
            for entry in entries[start : start + batch_size]:
                try:
                    tensors.append(transform(load_rgb(root / entry.path)).numpy())
                except Exception as exc:  # one unreadable image does not spoil the ranges
                    log.warning(
                        "Calibration skipped %s: %s: %s", entry.path, type(exc).__name__, exc
                    )
            if tensors:
                self.used += len(tensors)
                yield {INPUT_NAME: np.stack(tensors)}

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._batches, None)


def _validation_labels(validation: Path, manifest: Manifest, info: ModelInfo) -> list[int]:
    """Each validation image's class as the model's class id (the classes are matched by name)."""
    require_labeled(manifest, "validation", validation)  # top-1 needs the true classes
    unknown = sorted(set(manifest.classes) - set(info.classes))
    if unknown:
        raise InvalidDatasetError(
            f"The validation directory {validation} has classes the model does not know: "
            f"{unknown} (the model's: {info.classes}).",
            "Pass the validation split of the data the model was trained on.",
        )
    ids = {name: i for i, name in enumerate(info.classes)}
    return [ids[manifest.classes[int(e.label)]] for e in manifest.images]  # type: ignore[arg-type]


def measure_top1(
    model_paths: list[Path],
    validation: Path,
    info: ModelInfo,
    *,
    batch_size: int = 32,
    threads: int | None = None,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Predicted class ids of each ONNX model on ``validation``, and the true class ids.

    Each batch is decoded once and run through every model, so the models see the very same
    tensors. Unreadable images are left out of every model's count alike.
    """
    manifest = read_manifest(validation)
    labels = _validation_labels(validation, manifest, info)
    sessions = [inference_session(path, threads) for path in model_paths]
    transform = transform_for(info.transform, "inference", validation, manifest.transform)
    log = step_logger(__name__)
    predictions: list[list[np.ndarray]] = [[] for _ in sessions]
    truth: list[int] = []
    for start in range(0, len(manifest.images), batch_size):
        tensors = []
        for entry, label in zip(
            manifest.images[start : start + batch_size],
            labels[start : start + batch_size],
            strict=True,
        ):
            try:
                tensors.append(transform(load_rgb(validation / entry.path)).numpy())
            except Exception as exc:
                log.warning("Validation skipped %s: %s: %s", entry.path, type(exc).__name__, exc)
                continue
            truth.append(label)
        if not tensors:
            continue
        batch = np.stack(tensors)
        for session, out in zip(sessions, predictions, strict=True):
            (logits,) = session.run([OUTPUT_NAME], {INPUT_NAME: batch})
            out.append(logits.argmax(axis=1))
    if not truth:
        raise NoUsableImagesError(
            f"None of the {len(manifest.images)} image(s) in {validation} could be read.",
            "Re-create the validation ImageDirectory with `imageops convert`.",
        )
    return [np.concatenate(p) for p in predictions], np.asarray(truth)


def _check_parameters(max_top1_drop: float, calibration_images: int, batch_size: int) -> None:
    if not 0 <= max_top1_drop <= 100:
        raise InvalidParameterError(
            f"max_top1_drop must be between 0 and 100 (percentage points), got {max_top1_drop}.",
            "Use e.g. 0.5 to allow INT8 half a point less top-1 than fp32.",
        )
    if calibration_images < 1:
        raise InvalidParameterError(
            f"calibration_images must be >= 1, got {calibration_images}.",
            "A few hundred training images (default 256) calibrate a CNN well.",
        )
    if batch_size < 1:
        raise InvalidParameterError(f"batch_size must be >= 1, got {batch_size}.")


def _remove_int8(model_dir: Path) -> None:
    (model_dir / ONNX_INT8).unlink(missing_ok=True)
    (model_dir / INT8_REPORT).unlink(missing_ok=True)


def quantize(
    model_dir: Path,
    calibration: Path,
    validation: Path,
    *,
    max_top1_drop: float = 0.5,
    calibration_images: int = 256,
    batch_size: int = 32,
    threads: int | None = None,
) -> QuantizeResult:
    """Quantize ``model_dir/model.onnx`` to static INT8 (QDQ); keep it if top-1 holds up.

    ``calibration_images`` images of ``calibration`` set the activation ranges; ``validation``
    (labeled) measures both models; ``max_top1_drop``: the most top-1 points (0..100) INT8 may lose.
    Returns the result; ``model.int8.onnx`` and ``model.int8.json`` are written atomically. Raises
    QuantizationAccuracyError over the drop (none is left behind), InvalidParameterError,
    InvalidModelDirectoryError, NotLabeledDatasetError, InvalidDatasetError, NoUsableImagesError
    (when each: docs/precision.md#quantize-arguments-and-errors).
    """
    model_dir, calibration, validation = Path(model_dir), Path(calibration), Path(validation)
    _check_parameters(max_top1_drop, calibration_images, batch_size)
    info = read_model_info(model_dir)
    fp32 = model_dir / ONNX
    if not fp32.is_file():
        raise InvalidModelDirectoryError(
            f"{model_dir} has no {ONNX} to quantize.", f"Run `imageops export {model_dir}` first."
        )
    # Read both manifests before the minutes of work, so a bad directory fails at once.
    calib_manifest = read_manifest(calibration)
    _validation_labels(validation, read_manifest(validation), info)
    entries = calibration_entries(calib_manifest, calibration_images)
    log = step_logger(__name__)
    dest = model_dir / ONNX_INT8

    with tempfile.TemporaryDirectory(prefix="imageops-quantize-") as work:
        # Pre-processing: ORT's graph optimisations and ONNX shape inference, which the quantizer
        # needs to place the QDQ pairs. The symbolic shape inference (for transformer-style
        # dynamic shapes) is skipped: a CNN's shapes are all static but the batch, and it costs
        # 5 s for resnet18.
        prepared = Path(work) / "prepared.onnx"
        quant_pre_process(str(fp32), str(prepared), skip_symbolic_shape=True)
        reader = _CalibrationReader(calibration, entries, info, batch_size)
        with atomic_file(dest) as tmp:
            quantize_static(
                str(prepared),
                str(tmp),
                reader,
                quant_format=QuantFormat.QDQ,
                # u8 activations with s8 weights: the pair ORT's x86 int8 kernels (VNNI) use.
                activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                per_channel=True,  # one scale per output channel: ResNet weights need it
                calibrate_method=CalibrationMethod.MinMax,
            )
            if not reader.used:
                raise NoUsableImagesError(
                    f"None of the {len(entries)} calibration image(s) in {calibration} could be "
                    "read.",
                    "Pass the training ImageDirectory (re-create it with `imageops convert`).",
                )
            proto = onnx.load(str(tmp))
            onnx.checker.check_model(proto, full_check=True)
            calibrated = {
                "calibration": str(calibration.resolve()),
                "calibration_images": reader.used,
                "method": "minmax",
                "scheme": "QDQ, uint8 activations, int8 per-channel weights",
            }
            proto.metadata_props.add(key=META_QUANTIZATION, value=json.dumps(calibrated))
            onnx.save(proto, str(tmp))
            del proto

            (fp32_pred, int8_pred), truth = measure_top1(
                [fp32, tmp], validation, info, batch_size=batch_size, threads=threads
            )
            fp32_top1 = float((fp32_pred == truth).mean())
            int8_top1 = float((int8_pred == truth).mean())
            # Rounded: 0.1 + 0.2 points must not fail a 0.3 gate by a float's last bit.
            drop = round(100.0 * (fp32_top1 - int8_top1), 9)
            agreement = float((fp32_pred == int8_pred).mean())
            if 100.0 / len(truth) > max_top1_drop:
                log.warning(
                    "One validation image is worth %.2f top-1 points, more than max_top1_drop "
                    "= %g: a single changed answer refuses the INT8 model.",
                    100.0 / len(truth),
                    max_top1_drop,
                )
            if drop > max_top1_drop:
                _remove_int8(model_dir)
                raise QuantizationAccuracyError(
                    f"INT8 loses {drop:.2f} top-1 points on {len(truth)} validation image(s) "
                    f"({100 * fp32_top1:.2f}% fp32 -> {100 * int8_top1:.2f}% int8), more than "
                    f"max_top1_drop = {max_top1_drop:g}; {ONNX_INT8} was not written.",
                    f"Calibrate on more training images (calibration_images: {reader.used} of "
                    f"{len(calib_manifest.images)} used), raise max_top1_drop if that loss is "
                    f"acceptable, or keep scoring with the fp32 {ONNX}.",
                )
    result = QuantizeResult(
        path=dest,
        fp32_top1=fp32_top1,
        int8_top1=int8_top1,
        top1_drop=drop,
        agreement=agreement,
        calibration_images=reader.used,
        validation_images=len(truth),
    )
    write_json(
        model_dir / INT8_REPORT,
        {
            "format": REPORT_FORMAT,
            "format_version": 1,
            "model": ONNX_INT8,
            "fp32_top1": fp32_top1,
            "int8_top1": int8_top1,
            "top1_drop_points": drop,
            "max_top1_drop_points": max_top1_drop,
            "agreement": agreement,
            "validation": str(validation.resolve()),
            "validation_images": len(truth),
            **calibrated,
        },
    )
    log.info(
        "Quantized %s: top-1 %.2f%% fp32 -> %.2f%% int8 (drop %.2f points, limit %g), "
        "calibrated on %d image(s)",
        dest,
        100 * fp32_top1,
        100 * int8_top1,
        drop,
        max_top1_drop,
        reader.used,
    )
    return result


__getattr__ = tasks_on_first_use(
    globals(),
    quantize_task=lambda: step(quantize, name="quantize"),
)
