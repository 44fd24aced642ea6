"""Helpers for the model tests: a trained-format ModelDirectory without training.

The model is an untrained resnet18 with a seeded head (these tests are about files, the runtime and
the bookkeeping, not accuracy), saved in the real ModelDirectory format.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from models.directory import ModelInfo, save_model_directory
from models.transform_spec import TransformSpec
from models.untrained import resnet
from models.zoo import build_model

SIZE = 16


def make_model_dir(
    dest: Path, classes: list[str], seed: int = 0, transform: TransformSpec | None = None
) -> Path:
    """A ModelDirectory with seeded random weights for ``classes`` (no model.onnx yet).

    ``transform``: the spec stored in model.json (default: resize and center crop to SIZE).
    """
    spec = resnet("resnet18", pretrained=False)
    torch.manual_seed(seed)
    model = build_model(spec, len(classes))
    info = ModelInfo(
        architecture=spec,
        classes=classes,
        transform=transform or TransformSpec(resize_size=SIZE, center_crop_size=SIZE),
        train_params={"epochs": 1, "batch_size": 16, "learning_rate": 0.001},
        metrics={"val/top1": 0.5, "val/loss": 1.1},
        data_version={"train": "0" * 32},
    )
    return save_model_directory(dest, model, info)


def copy_model(src: Path, dest: Path) -> Path:
    """A copy of a session model directory that a test may change."""
    shutil.copytree(src, dest)
    return dest
