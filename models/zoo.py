"""The model zoo: the seed's DenseNet and ResNet components, built from torchvision.

A component writes an UntrainedModelDirectory: ``model.json`` naming the architecture and its
options, no weights and nothing pickled. The network is built at train time, when the number of
classes is known (:func:`build_model`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import torch
import torchvision
from pydantic import BaseModel, ConfigDict, ValidationError
from torch import nn

from models.atomic import atomic_directory, write_json
from models.errors import ImageOpsError, InvalidModelDirectoryError

MODEL_JSON = "model.json"
UNTRAINED_FORMAT = "imageops.UntrainedModelDirectory"

DENSENETS = ("densenet121", "densenet161", "densenet169", "densenet201")
RESNETS = (
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "resnext50_32x4d",
    "resnext101_32x8d",
    "wide_resnet50_2",
    "wide_resnet101_2",
)


class PretrainedWeightsMissingError(ImageOpsError):
    """Pretrained weights are neither in the local cache nor downloadable."""


class ModelSpec(BaseModel):
    """``model.json`` of an UntrainedModelDirectory: the architecture and its options."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["imageops.UntrainedModelDirectory"] = UNTRAINED_FORMAT
    format_version: int = 1
    family: Literal["densenet", "resnet"]
    arch: str
    pretrained: bool
    memory_efficient: bool = False
    zero_init_residual: bool = False


def densenet(
    model_name: str = "densenet201", pretrained: bool = True, memory_efficient: bool = False
) -> ModelSpec:
    """Seed DenseNet component (defaults: densenet201, pretrained, not memory efficient)."""
    _check_name(model_name, DENSENETS, "DenseNet")
    return ModelSpec(
        family="densenet", arch=model_name, pretrained=pretrained, memory_efficient=memory_efficient
    )


def resnet(
    model_name: str = "resnext101_32x8d", pretrained: bool = True, zero_init_residual: bool = False
) -> ModelSpec:
    """Seed ResNet component (defaults: resnext101_32x8d, pretrained, no zero-init residual)."""
    _check_name(model_name, RESNETS, "ResNet")
    return ModelSpec(
        family="resnet",
        arch=model_name,
        pretrained=pretrained,
        zero_init_residual=zero_init_residual,
    )


def spec_for(
    model_name: str,
    pretrained: bool = False,
    *,
    memory_efficient: bool = False,
    zero_init_residual: bool = False,
) -> ModelSpec:
    """The spec for any zoo architecture, by name; a switch of the other family is refused."""
    if model_name in DENSENETS:
        if zero_init_residual:
            raise InvalidModelDirectoryError(
                f"zero_init_residual applies to ResNets, not {model_name}.", "Leave it off."
            )
        return densenet(model_name, pretrained, memory_efficient)
    if model_name in RESNETS:
        if memory_efficient:
            raise InvalidModelDirectoryError(
                f"memory_efficient applies to DenseNets, not {model_name}.", "Leave it off."
            )
        return resnet(model_name, pretrained, zero_init_residual)
    _check_name(model_name, DENSENETS + RESNETS, "imageops")
    raise AssertionError("unreachable")


def _check_name(name: str, allowed: tuple[str, ...], family: str) -> None:
    if name not in allowed:
        raise InvalidModelDirectoryError(
            f"Unknown {family} model name {name!r}.", f"Choose one of: {', '.join(allowed)}."
        )


def write_untrained(spec: ModelSpec, dest: Path) -> Path:
    """Write the UntrainedModelDirectory for ``spec`` to ``dest`` (atomically)."""
    with atomic_directory(Path(dest)) as tmp:
        write_json(tmp / MODEL_JSON, spec.model_dump(mode="json"))
    return Path(dest)


def read_untrained(path: Path) -> ModelSpec:
    """Read an UntrainedModelDirectory; anything else is the seed's InvalidModelDirectoryError."""
    path = Path(path)
    hint = "Create one with `imageops model resnet DEST` or `imageops model densenet DEST`."
    if not (path / MODEL_JSON).is_file():
        raise InvalidModelDirectoryError(f"{path} is not a model directory: no {MODEL_JSON}.", hint)
    try:
        spec = ModelSpec.model_validate_json((path / MODEL_JSON).read_bytes())
    except ValidationError as exc:
        raise InvalidModelDirectoryError(
            f"{path / MODEL_JSON} is not an untrained PyTorch model directory "
            f"({exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}).",
            hint,
        ) from exc
    allowed = DENSENETS if spec.family == "densenet" else RESNETS
    _check_name(spec.arch, allowed, "DenseNet" if spec.family == "densenet" else "ResNet")
    return spec


def build_model(spec: ModelSpec, num_classes: int) -> nn.Module:
    """Build the torchvision network for ``spec`` with a ``num_classes``-way head.

    Pretrained weights come through torchvision's weights API from the cache under ``TORCH_HOME``
    (``<TORCH_HOME>/hub/checkpoints/<file>``), downloaded there when the network allows; the
    ImageNet head is then replaced by a fresh one for our classes.
    """
    options: dict[str, bool] = {}
    if spec.family == "densenet":
        options["memory_efficient"] = spec.memory_efficient
    else:
        options["zero_init_residual"] = spec.zero_init_residual
    if not spec.pretrained:
        return torchvision.models.get_model(
            spec.arch, weights=None, num_classes=num_classes, **options
        )
    weights = torchvision.models.get_model_weights(spec.arch).DEFAULT
    model = torchvision.models.get_model(spec.arch, weights=None, **options)
    model.load_state_dict(_load_pretrained_state(weights))
    _replace_head(model, num_classes)
    return model


def pretrained_weights_path(arch: str) -> Path:
    """Where the pretrained weights file for ``arch`` is looked for (and downloaded to)."""
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(weights.url)


def _load_pretrained_state(weights: torchvision.models.WeightsEnum) -> dict[str, torch.Tensor]:
    path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(weights.url)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            torch.hub.download_url_to_file(weights.url, str(path), progress=False)
        except Exception as exc:  # no network, proxy, DNS: all mean the same to the user
            raise PretrainedWeightsMissingError(
                f"Pretrained weights {path.name} are not in the cache and could not be "
                f"downloaded ({type(exc).__name__}).",
                f"Copy the file from {weights.url} to {path} (set IMAGEOPS_WEIGHTS_CACHE to "
                "change the cache folder), or train with pretrained=false.",
            ) from exc
    # weights_only: a weights file is data, never code.
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    return state


def _replace_head(model: nn.Module, num_classes: int) -> None:
    if isinstance(model, torchvision.models.DenseNet):
        model.classifier = nn.Linear(model.classifier.in_features, num_classes)
    else:
        model.fc = nn.Linear(model.fc.in_features, num_classes)
