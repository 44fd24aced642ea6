"""Model fixtures for the export, registry, score and evaluate tests (a pytest plugin).

Test modules load it with ``pytest_plugins = ["model_fixtures"]``. Exporting costs seconds, so the
exported ModelDirectory is built once per session; a test that changes it works on a copy
(:func:`model_helpers.copy_model`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from model_helpers import make_model_dir

from tasks.data.imagedir import read_manifest


@pytest.fixture(scope="session")
def model_classes(digits_split: tuple[Path, Path]) -> list[str]:
    """The digits classes, in the manifest's (class id) order."""
    return read_manifest(digits_split[0]).classes


@pytest.fixture(scope="session")
def exported_model(
    tmp_path_factory: pytest.TempPathFactory,
    digits_split: tuple[Path, Path],
    model_classes: list[str],
) -> Path:
    """A ModelDirectory with model.onnx, parity-checked on the validation digits.

    Do not modify: copy it first.
    """
    from tasks.inference.export import export_onnx

    model_dir = make_model_dir(tmp_path_factory.mktemp("models") / "resnet18", model_classes)
    export_onnx(model_dir, sample=digits_split[1])
    return model_dir
