"""The registered model as MLflow consumers call it: images in, class labels and probabilities out.

Logged as code with the model by ``imageops register``, so it imports only the model's own
requirements (numpy, pandas, Pillow, ONNX Runtime, MLflow), never imageops or torch, and
unpickles nothing. Its preprocessing redoes the model's inference transform with Pillow and
numpy, to the bit, and refuses values that are not images (pixels already scaled would give
confident wrong labels). Inputs, outputs, the steps: docs/images.md#registered-model.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

import mlflow
import numpy as np
import onnxruntime as ort
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from PIL import Image

IMAGE_COLUMN = "image"
PROBABILITY_PREFIX = "Scored Probabilities_"
LABEL_COLUMN = "Scored Labels"
# What imageops opens (tasks/data/imageformat.py): anything else is refused even if it decodes.
PIL_FORMATS = ("JPEG", "PNG", "PPM", "BMP", "TIFF", "WEBP")
INPUT_NAME = "input"  # the exported ONNX model's input and output (tasks/inference/export.py)
OUTPUT_NAME = "logits"
BATCH = 64  # images per ONNX Runtime call: memory stays flat however many are sent
# torchvision's rgb_to_grayscale weights, as the float32 values its kernel multiplies by.
_GRAY = tuple(np.float32(w) for w in (0.2989, 0.587, 0.114))


def _refuse(message: str) -> MlflowException:
    # INVALID_PARAMETER_VALUE: the scoring server answers 400 with this message, not a 500.
    return MlflowException(message, error_code=INVALID_PARAMETER_VALUE)


def to_rgb(img: Image.Image) -> Image.Image:
    """8-bit RGB as imageops reads a file: 16-bit gray scaled, transparency on white."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        arr = np.asarray(img, dtype=np.float64)
        top = 65535.0 if img.mode.startswith("I;16") else max(float(arr.max()), 1.0)
        img = Image.fromarray(np.rint(arr * (255.0 / top)).clip(0, 255).astype(np.uint8))
    elif (img.mode == "P" and "transparency" in img.info) or img.mode == "PA":
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA"):
        background = Image.new("RGB", img.size, (255, 255, 255))
        background.paste(img, mask=img.getchannel("A"))
        return background
    return img.convert("RGB")


def decode(data: bytes) -> np.ndarray:
    """An encoded image file as an HxWx3 uint8 array; decompression bombs are refused."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with Image.open(io.BytesIO(data), formats=PIL_FORMATS) as img:
            img.load()
            return np.asarray(to_rgb(img))


def rgb_pixels(value: Any, index: int = 0) -> np.ndarray:
    """One input value as an HxWx3 uint8 array: encoded bytes are decoded, arrays checked.

    Raises an MlflowException (INVALID_PARAMETER_VALUE) naming the image and what is wrong.
    """
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            return decode(bytes(value))
        except Exception as exc:  # Pillow raises many types (OSError, SyntaxError, ...)
            raise _refuse(
                f"image {index} is not a readable image file ({type(exc).__name__}: {exc}); "
                f"the model reads {', '.join(PIL_FORMATS)}."
            ) from None
    if isinstance(value, (list, tuple)):
        value = np.asarray(value)
    if not isinstance(value, np.ndarray):
        raise _refuse(
            f"image {index} is a {type(value).__name__}: pass the bytes of an image file "
            "(base64 in a JSON request) or an HxWx3 array of uint8 pixels."
        )
    if value.dtype != np.uint8:
        if value.dtype.kind not in "iu" or (value.size and (value.min() < 0 or value.max() > 255)):
            raise _refuse(
                f"image {index} has {value.dtype} pixels"
                + (f" from {value.min():g} to {value.max():g}" if value.size else "")
                + ": pass uint8 pixels 0-255, as decoded from the file. The model scales and "
                "normalises them itself; scaled or normalised pixels would be scored wrong."
            )
        value = value.astype(np.uint8)
    if value.ndim == 3 and value.shape[2] == 1:
        value = value[..., 0]
    if value.ndim == 2 or (value.ndim == 3 and value.shape[2] in (3, 4)):
        if value.size == 0:
            raise _refuse(f"image {index} is empty ({value.shape}).")
        if value.ndim == 3 and value.shape[2] == 3:
            return np.ascontiguousarray(value)
        return np.asarray(to_rgb(Image.fromarray(value)))  # gray or RGBA, as a file of it reads
    raise _refuse(
        f"image {index} has shape {value.shape}: pass one image per row, HxWx3 (RGB), HxWx4 "
        "(RGBA) or HxW (gray)."
    )


@lru_cache(maxsize=64)
def _resample_matrix(in_size: int, out_size: int) -> tuple[np.ndarray, int]:
    """torchvision's antialiased bilinear weights for one axis, as integers, and their precision.

    ATen's ``_compute_indices_min_size_weights_aa`` and ``_compute_index_ranges_int16_weights``
    (the uint8 path): Pillow's support and centering, weights normalised per output pixel, then
    scaled to int16 with as many fraction bits as the largest weight allows.
    """
    scale = in_size / out_size
    support = scale if scale >= 1.0 else 1.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    taps = math.ceil(support) * 2 + 1
    rows: list[tuple[int, list[float]]] = []
    largest = 0.0
    for i in range(out_size):
        center = scale * (i + 0.5)
        first = max(int(center - support + 0.5), 0)
        count = min(max(min(int(center + support + 0.5), in_size) - first, 0), taps)
        weights = []
        for j in range(count):
            x = abs((j + first - center + 0.5) * invscale)
            weights.append(1.0 - x if x < 1.0 else 0.0)
        total = 0.0
        for w in weights:  # summed in order, as ATen does
            total += w
        if total != 0.0:
            weights = [w / total for w in weights]
            largest = max(largest, *weights)
        rows.append((first, weights))
    precision = 0
    while precision < 22 and int(0.5 + largest * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    matrix = np.zeros((out_size, in_size), dtype=np.float64)
    for i, (first, weights) in enumerate(rows):
        for j, w in enumerate(weights):
            v = w * (1 << precision)
            matrix[i, first + j] = int(-0.5 + v) if v < 0 else int(0.5 + v)
    return matrix, precision


def _resample(pixels: np.ndarray, axis: int, size: int) -> np.ndarray:
    matrix, precision = _resample_matrix(pixels.shape[axis], size)
    moved = np.moveaxis(pixels, axis, 0)
    flat = moved.reshape(moved.shape[0], -1).astype(np.float64)
    # Integer weights times 8-bit pixels: every sum is an integer far below 2**53, so the float
    # matrix product is exact whatever order BLAS adds in.
    acc = (matrix @ flat).astype(np.int64)
    if precision:
        acc = (acc + (1 << (precision - 1))) >> precision
    out = np.clip(acc, 0, 255).astype(np.uint8).reshape((size, *moved.shape[1:]))
    return np.moveaxis(out, 0, axis)


def resize(pixels: np.ndarray, shorter: int) -> np.ndarray:
    """``v2.Resize(shorter, antialias=True)`` of an HxWxC uint8 image: width first, then height."""
    h, w = pixels.shape[:2]
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = shorter, int(shorter * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    if new_w != w:
        pixels = _resample(pixels, 1, new_w)
    if new_h != h:
        pixels = _resample(pixels, 0, new_h)
    return pixels


def center_crop(pixels: np.ndarray, size: int) -> np.ndarray:
    """``v2.CenterCrop(size)``: zero padding first where the image is smaller than the crop."""
    h, w = pixels.shape[:2]
    if size > h or size > w:
        dh, dw = max(size - h, 0), max(size - w, 0)
        pixels = np.pad(pixels, ((dh // 2, (dh + 1) // 2), (dw // 2, (dw + 1) // 2), (0, 0)))
        h, w = pixels.shape[:2]
    top, left = round((h - size) / 2.0), round((w - size) / 2.0)  # torchvision's anchor
    return pixels[top : top + size, left : left + size]


def grayscale(pixels: np.ndarray) -> np.ndarray:
    """``v2.Grayscale(3)`` of uint8 RGB: torchvision's float32 multiply-adds, truncated to uint8.

    Its kernel fuses each ``add(g, alpha=w)`` into one rounding (a fused multiply-add); float64
    holds ``w * g`` and the sum exactly, so one cast to float32 rounds the same way.
    """
    r, g, b = (pixels[..., i].astype(np.float32) for i in range(3))
    gray = r * _GRAY[0]
    gray = (gray.astype(np.float64) + g.astype(np.float64) * np.float64(_GRAY[1])).astype(
        np.float32
    )
    gray = (gray.astype(np.float64) + b.astype(np.float64) * np.float64(_GRAY[2])).astype(
        np.float32
    )
    return np.repeat(gray.astype(np.uint8)[..., None], 3, axis=2)


def preprocess(pixels: np.ndarray, config: Mapping[str, Any]) -> np.ndarray:
    """An HxWx3 uint8 image as the network's 3xSxS float32 input (``config``: model_config)."""
    if config.get("resize") is not None:
        pixels = resize(pixels, int(config["resize"]))
    pixels = center_crop(pixels, int(config["center_crop"]))
    if config.get("padding"):
        n = int(config["padding"])
        pixels = np.pad(pixels, ((n, n), (n, n), (0, 0)))
    if config.get("grayscale"):
        pixels = grayscale(pixels)
    scaled = pixels.transpose(2, 0, 1).astype(np.float32) * np.float32(1.0 / 255)
    mean = np.asarray(config["mean"], dtype=np.float32).reshape(3, 1, 1)
    std = np.asarray(config["std"], dtype=np.float32).reshape(3, 1, 1)
    return (scaled - mean) / std


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities per row, in float64 (as ``imageops score`` computes them)."""
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def _values(model_input: Any) -> list[Any]:
    if isinstance(model_input, pd.DataFrame):
        if IMAGE_COLUMN not in model_input.columns:
            raise _refuse(
                f"The input has columns {list(model_input.columns)}; the model reads one column "
                f"{IMAGE_COLUMN!r}: image file bytes or HxWx3 uint8 arrays, one image per row."
            )
        return list(model_input[IMAGE_COLUMN])
    if isinstance(model_input, Mapping) and IMAGE_COLUMN in model_input:
        return list(model_input[IMAGE_COLUMN])
    if isinstance(model_input, Iterable) and not isinstance(model_input, (str, bytes, np.ndarray)):
        return list(model_input)
    raise _refuse(
        f"The input is a {type(model_input).__name__}; pass a DataFrame with a column "
        f"{IMAGE_COLUMN!r} (image file bytes or HxWx3 uint8 arrays, one image per row)."
    )


class ImageClassifier(mlflow.pyfunc.PythonModel):
    """The exported ONNX model behind its own preprocessing and class names."""

    def load_context(self, context: mlflow.pyfunc.PythonModelContext) -> None:
        self.config = dict(context.model_config)
        self.classes = np.asarray(self.config["classes"], dtype=object)
        providers = ["CPUExecutionProvider"]
        if "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        self.session = ort.InferenceSession(context.artifacts["onnx_model"], providers=providers)

    def predict(
        self,
        context: mlflow.pyfunc.PythonModelContext,
        model_input: pd.DataFrame,
        params: dict[str, Any] | None = None,
    ) -> pd.DataFrame:
        """One row per image: a probability per class, then ``Scored Labels``."""
        values = _values(model_input)
        probs = np.empty((len(values), len(self.classes)))
        for start in range(0, len(values), BATCH):
            batch = range(start, min(start + BATCH, len(values)))
            tensors = [preprocess(rgb_pixels(values[i], i), self.config) for i in batch]
            (logits,) = self.session.run([OUTPUT_NAME], {INPUT_NAME: np.stack(tensors)})
            probs[batch.start : batch.stop] = softmax(logits)
        out = {f"{PROBABILITY_PREFIX}{c}": probs[:, i] for i, c in enumerate(self.classes)}
        out[LABEL_COLUMN] = self.classes[probs.argmax(axis=1)]
        return pd.DataFrame(out)


mlflow.models.set_model(ImageClassifier())
