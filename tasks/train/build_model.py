"""The DenseNet / ResNet components (and any network of the zoo) as a pipeline step: write an
UntrainedModelDirectory."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from models.untrained import ModelChoice, ModelSpec, write_untrained
from tasks.shared.step import step, tasks_on_first_use
from tasks.shared.validation import checked


def build_model(choice: ModelChoice | Mapping[str, Any], dest: Path) -> ModelSpec:
    """Write the UntrainedModelDirectory of ``choice`` (any network of the zoo) to ``dest``.

    An unknown name or a switch of the other family is Azure's InvalidModelDirectoryError; a timm
    name is checked against timm's list here (imported only for a timm name), not at training.
    """
    if not isinstance(choice, ModelChoice):
        choice = model_choice(**dict(choice))
    spec = choice.spec()
    if spec.family == "timm":
        from models.pretrained import timm_model_name

        timm_model_name(spec)
    write_untrained(spec, Path(dest))
    return spec


def model_choice(**values: Any) -> ModelChoice:
    """A ModelChoice from option values: an unknown name is InvalidModelDirectoryError (as the
    Azure component says), a value of the wrong type InvalidParameterError."""
    return checked(ModelChoice, values, "model option")


__getattr__ = tasks_on_first_use(
    globals(),
    build_model_task=lambda: step(build_model, name="build-model"),
)
