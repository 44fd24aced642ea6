"""The DenseNet / ResNet components as a pipeline step: write an UntrainedModelDirectory."""

from __future__ import annotations

from pathlib import Path

from models.zoo import ModelSpec, spec_for, write_untrained
from tasks.step import step


def build_model(
    model_name: str,
    dest: Path,
    *,
    pretrained: bool = False,
    memory_efficient: bool = False,
    zero_init_residual: bool = False,
) -> ModelSpec:
    """Write the UntrainedModelDirectory for ``model_name`` (any DenseNet or ResNet) to ``dest``.

    ``memory_efficient`` is a DenseNet switch, ``zero_init_residual`` a ResNet one. An unknown
    name is the seed's InvalidModelDirectoryError.
    """
    spec = spec_for(
        model_name,
        pretrained,
        memory_efficient=memory_efficient,
        zero_init_residual=zero_init_residual,
    )
    write_untrained(spec, Path(dest))
    return spec


build_model_task = step(build_model, name="build-model")
