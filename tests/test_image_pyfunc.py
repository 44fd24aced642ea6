"""The registered model's own preprocessing (models/image_pyfunc.py) against imageops' transform.

The pyfunc runs where imageops is not installed, so it redoes the inference transform with Pillow
and numpy. These tests hold it to the bit: the same tensors as ``build_transform(spec,
"inference")`` for every kind of step, and the same RGB pixels as imageops reads from a file.
"""

from __future__ import annotations

import ast
import io
import platform
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from models import image_pyfunc
from models.transform_spec import TransformSpec
from tasks.data.imagedir import load_rgb
from tasks.data.transform import build_transform, inference_steps
from tasks.inference.score import LABEL_COLUMN, PROBABILITY_PREFIX
from tasks.registry.register import IMAGE_COLUMN, ONNX_ARTIFACT, PYFUNC_CODE, PYFUNC_REQUIREMENTS

SPECS = {
    "resize-and-crop": TransformSpec(resize_size=16, center_crop_size=16),
    "defaults-256-224": TransformSpec(),
    "crop-share-pad-gray": TransformSpec(
        resize_size=20,
        center_crop_size=16,
        random_crop=True,
        random_crop_size=12,
        pad=True,
        padding=2,
        grayscale=True,
    ),
    "no-resize-own-stats": TransformSpec(
        resize=False, center_crop_size=24, mean=[0.5, 0.4, 0.3], std=[0.2, 0.3, 0.25]
    ),
    "random-resized-crop-gray": TransformSpec(
        resize_size=30,
        center_crop=False,
        random_resized_crop=True,
        random_resized_crop_size=28,
        grayscale=True,
    ),
    "crop-larger-than-resize": TransformSpec(
        resize_size=12, center_crop_size=20, pad=True, padding=3
    ),
}
# (height, width): thin, tiny, smaller than every crop, square, large downscales, odd sizes.
SIZES = [(1, 37), (5, 3), (9, 9), (16, 16), (31, 17), (64, 48), (113, 250), (300, 41)]


def _images() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    images = []
    for i, (h, w) in enumerate(SIZES):
        noise = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        ramp = np.linspace(0, 255, h * w * 3).reshape(h, w, 3).astype(np.uint8)
        images.append(noise if i % 2 else ramp)
    return images


# torchvision resizes uint8 images with its integer kernel on these CPUs (the pyfunc's); on older
# x86 ones it resizes in float, and its own results move by a level.
UINT8_RESIZE = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or (
    platform.machine() in ("aarch64", "arm64")
)


@pytest.mark.skipif(not UINT8_RESIZE, reason="torchvision resizes in float on this CPU")
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_preprocessing_gives_the_tensors_of_the_inference_transform(spec: TransformSpec) -> None:
    transform = build_transform(spec, "inference")
    steps = inference_steps(spec)
    for pixels in _images():
        expected = transform(Image.fromarray(pixels)).numpy()
        got = image_pyfunc.preprocess(pixels, steps)
        assert got.dtype == np.float32
        assert got.shape == expected.shape == (3, steps["input_size"], steps["input_size"])
        np.testing.assert_array_equal(got, expected, err_msg=f"image {pixels.shape}")


def test_grayscale_rounds_as_torchvision_for_every_color() -> None:
    # All 2**24 colors, 16 reds at a time: torchvision truncates 0.2989 r + 0.587 g + 0.114 b
    # computed with fused multiply-adds, and 21 colors land on the other side of an integer
    # without them.
    spec = TransformSpec(resize=False, center_crop_size=1024, grayscale=True)
    transform = build_transform(spec, "inference", normalize=False)
    gb = np.arange(256 * 256, dtype=np.int64)
    for first in range(0, 256, 16):
        r = np.repeat(np.arange(first, first + 16), gb.size)
        g, b = np.tile(gb >> 8, 16), np.tile(gb & 255, 16)
        rgb = np.stack([r, g, b], axis=-1).astype(np.uint8).reshape(1024, 1024, 3)
        expected = transform(torch.from_numpy(rgb).permute(2, 0, 1)).permute(1, 2, 0).numpy()
        np.testing.assert_array_equal(image_pyfunc.grayscale(rgb), expected)


def _encoded(img: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format=fmt)
    return buffer.getvalue()


def test_decoding_gives_the_pixels_imageops_reads_from_files(tmp_path: Path) -> None:
    palette = Image.new("P", (12, 7), 1)
    palette.putpalette([0, 0, 0, 200, 30, 30] + [0] * 762)
    palette.info["transparency"] = 1
    images = {
        "gray.png": (Image.new("L", (20, 10), 90), "PNG"),
        "gray-alpha.png": (Image.new("LA", (20, 10), (40, 128)), "PNG"),
        "rgba.png": (Image.new("RGBA", (9, 11), (10, 200, 30, 100)), "PNG"),
        "palette.png": (palette, "PNG"),
        "gray16.png": (Image.new("I;16", (20, 10), 40000), "PNG"),
        "cmyk.jpg": (Image.new("CMYK", (20, 10), (0, 255, 255, 0)), "JPEG"),
        "photo.jpg": (Image.fromarray(_images()[5]), "JPEG"),
        "rgb.bmp": (Image.fromarray(_images()[4]), "BMP"),
    }
    for name, (img, fmt) in images.items():
        data = _encoded(img, fmt)
        (tmp_path / name).write_bytes(data)
        expected = np.asarray(load_rgb(tmp_path / name))
        np.testing.assert_array_equal(image_pyfunc.decode(data), expected, err_msg=name)
        assert image_pyfunc.rgb_pixels(data).shape == (*expected.shape[:2], 3)
    # Decoded arrays: gray and RGBA become RGB as their files would.
    rgba = np.asarray(images["rgba.png"][0])
    np.testing.assert_array_equal(
        image_pyfunc.rgb_pixels(rgba), np.asarray(load_rgb(tmp_path / "rgba.png"))
    )
    gray = np.asarray(images["gray.png"][0])
    np.testing.assert_array_equal(
        image_pyfunc.rgb_pixels(gray), np.asarray(load_rgb(tmp_path / "gray.png"))
    )


def test_the_model_code_imports_only_what_its_requirements_install() -> None:
    # MLflow runs this file where the model is loaded: nothing from imageops (or torch) may be
    # needed there, and everything it imports must be in the model's requirements.
    tree = ast.parse(PYFUNC_CODE.read_text())
    imported = {
        (alias.name if isinstance(node, ast.Import) else node.module).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    third_party = imported - set(sys.stdlib_module_names) - {"__future__"}
    installs = {"PIL": "pillow"}
    assert {installs.get(m, m) for m in third_party} == {*PYFUNC_REQUIREMENTS, "mlflow"}
    # The names the registry logs with are the ones the model reads and writes.
    assert image_pyfunc.IMAGE_COLUMN == IMAGE_COLUMN
    assert image_pyfunc.PROBABILITY_PREFIX == PROBABILITY_PREFIX
    assert image_pyfunc.LABEL_COLUMN == LABEL_COLUMN
    assert f'context.artifacts["{ONNX_ARTIFACT}"]' in PYFUNC_CODE.read_text()
