"""The model zoo: the seed's DenseNet and ResNet networks, built from torchvision.

The components' options and the UntrainedModelDirectory they write are in
:mod:`models.untrained` (no torch there); this module builds the network from them
(:func:`build_model`), with torchvision's pretrained weights when asked.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torchvision
from torch import nn

from models.errors import ImageOpsError
from models.untrained import (  # noqa: F401 - the zoo's public names, for its callers
    DENSENETS,
    MODEL_JSON,
    RESNETS,
    UNTRAINED_FORMAT,
    ModelChoice,
    ModelSpec,
    densenet,
    read_untrained,
    resnet,
    spec_for,
    write_untrained,
)


class PretrainedWeightsMissingError(ImageOpsError):
    """Pretrained weights are neither in the local cache nor downloadable."""


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
