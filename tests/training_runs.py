"""Small training runs for the training tests: 16-pixel digits, a fresh resnet18, CPU.

Test modules import :func:`run_train` and load the ``untrained`` fixture with
``pytest_plugins = ["training_runs"]``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from models.transform_spec import TransformSpec
from models.untrained import resnet, write_untrained
from tasks.shared.settings import Settings
from tasks.train.launch import TrainResult, train
from tasks.train.request import TrainRequest

PRE = TransformSpec(resize_size=16, center_crop_size=16, random_horizontal_flip=False)
FAST = {"epochs": 2, "batch_size": 8, "learning_rate": 0.01, "device": "cpu"}


@pytest.fixture
def untrained(tmp_path: Path) -> Path:
    """An untrained resnet18 ModelDirectory (no pretrained weights: nothing to download)."""
    return write_untrained(resnet("resnet18", pretrained=False), tmp_path / "untrained")


def run_train(
    settings: Settings,
    untrained: Path,
    data: tuple[Path, Path],
    out: Path,
    transform: TransformSpec = PRE,
    **params: object,
) -> TrainResult:
    """Train ``untrained`` on ``data`` (train, val) with FAST, overridden by ``params``."""
    train_data, val_data = data
    request = TrainRequest(
        model=untrained,
        train_data=train_data,
        val_data=val_data,
        out=out,
        params={**FAST, **params},
        transform=transform,
    )
    return train(request, settings)
