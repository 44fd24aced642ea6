"""Pipeline parameters: one typed model, the Prefect UI form, the shape of ``params.yaml``.

Defaults are the seed's, except where the bundled demo needs otherwise (resnet18 from scratch at
32x32 on two CPU processes instead of a pretrained resnext101 at 224x224 on one GPU).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.errors import InvalidParameterError
from tasks.train.params import TrainParams


class ModelChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        default="resnet18",
        title="Architecture",
        description="densenet121/161/169/201, resnet18/34/50/101/152, resnext50_32x4d, "
        "resnext101_32x8d, wide_resnet50_2, wide_resnet101_2.",
    )
    pretrained: bool = Field(
        default=False,
        title="Pretrained",
        description="Start from ImageNet weights (from the weights cache; needs the file there "
        "or network access).",
    )


class SplitChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fraction: float = Field(
        default=0.9, ge=0.0, le=1.0, title="Training fraction", description="Share per class."
    )
    seed: int = Field(default=1, title="Split seed")


class PipelineConfig(BaseModel):
    """Everything ``imageops run`` and the pipeline flow take."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(
        default="data/sample",
        title="Raw images",
        description="Folder (class sub-folders = labels) or .zip/.tar archive, relative to the "
        "project root.",
    )
    image_size: int = Field(
        default=32,
        gt=0,
        title="Image size",
        description="Images are resized and center-cropped to this square size.",
    )
    split: SplitChoice = Field(default_factory=SplitChoice)
    model: ModelChoice = Field(default_factory=ModelChoice)
    train: TrainParams = Field(default_factory=lambda: TrainParams(nproc_per_node=2))
    score_batch_size: int = Field(default=64, gt=0, title="Scoring batch size")
    version_data: bool = Field(
        default=True, title="Version data with DVC", description="dvc add + push every data set."
    )

    @classmethod
    def from_yaml(cls, path: Path) -> PipelineConfig:
        """Read a ``params.yaml``-shaped file; unknown keys and bad values are refused."""
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
            return cls.model_validate(data)
        except (OSError, yaml.YAMLError) as exc:
            raise InvalidParameterError(f"Cannot read {path}: {exc}.") from exc
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise InvalidParameterError(
                f"{path}: {where}: {first['msg']} (got {first.get('input')!r}).",
                "Fix the value in the file; `imageops run --help` lists every option.",
            ) from exc
