"""The model zoo: the Azure design's DenseNet and ResNet networks, built from torchvision.

The components' options and the UntrainedModelDirectory they write are in
:mod:`models.untrained` (no torch there); this module builds the network from them
(:func:`build_model`), with torchvision's pretrained weights when asked.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import torch
import torchvision
from torch import nn

from models.errors import ImageOpsError, InvalidModelDirectoryError
from models.untrained import FAMILIES, ModelSpec


class PretrainedWeightsMissingError(ImageOpsError):
    """Pretrained weights are neither in the local cache nor downloadable."""


class Network:
    """How the networks of one family are built from torchvision: options, weights, head.

    ``head``: the attribute holding the final ``nn.Linear``, replaced by one for our classes.
    A family with its own needs overrides :meth:`fix_state` (old key names in its files).
    """

    head = "fc"

    def options(self, spec: ModelSpec) -> dict[str, bool]:
        """The family's switch, as torchvision's builder takes it."""
        switch = FAMILIES[spec.family].switch
        return {switch: getattr(spec, switch)} if switch else {}

    def fix_state(self, state: dict[str, torch.Tensor]) -> None:
        """Adapt a published weights file's keys to the network's, in place."""

    def replace_head(self, model: nn.Module, num_classes: int) -> None:
        old = getattr(model, self.head)
        setattr(model, self.head, nn.Linear(old.in_features, num_classes))


class DenseNetNetwork(Network):
    head = "classifier"

    def fix_state(self, state: dict[str, torch.Tensor]) -> None:
        _rename_densenet_keys(state)


# One entry per models.untrained.FAMILIES entry.
NETWORKS: dict[str, Network] = {"densenet": DenseNetNetwork(), "resnet": Network()}


def network_for(spec: ModelSpec) -> Network:
    """The builder of ``spec``'s family; a family without one is refused, never guessed."""
    try:
        return NETWORKS[spec.family]
    except KeyError:
        raise InvalidModelDirectoryError(
            f"No network builder for the model family {spec.family!r} ({spec.arch}).",
            f"Use one of: {', '.join(NETWORKS)}.",
        ) from None


def head_parameters(spec: ModelSpec, model: nn.Module) -> set[int]:
    """The ids of the parameters of ``model``'s classification head (the layer replaced for our
    classes): what transfer learning trains alone first, or at another rate than the backbone."""
    head = getattr(model, network_for(spec).head)
    return {id(p) for p in head.parameters()}


def build_model(spec: ModelSpec, num_classes: int) -> nn.Module:
    """Build the torchvision network for ``spec`` with a ``num_classes``-way head.

    Pretrained weights are torchvision's published files, read from the cache under
    ``TORCH_HOME`` (``<TORCH_HOME>/hub/checkpoints/<file>``) and downloaded there when the
    network allows; the ImageNet head is then replaced by a fresh one for our classes.
    """
    network = network_for(spec)
    options = network.options(spec)
    if not spec.pretrained:
        return torchvision.models.get_model(
            spec.arch, weights=None, num_classes=num_classes, **options
        )
    weights = torchvision.models.get_model_weights(spec.arch).DEFAULT
    model = torchvision.models.get_model(spec.arch, weights=None, **options)
    path = _cached_weights_file(weights, spec)
    state = _load_pretrained_state(path, spec)
    network.fix_state(state)
    _load_into(model, state, path, spec)
    network.replace_head(model, num_classes)
    return model


def pretrained_weights_path(arch: str) -> Path:
    """Where the pretrained weights file for ``arch`` is looked for (and downloaded to)."""
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(weights.url)


def _cached_weights_file(weights: torchvision.models.WeightsEnum, spec: ModelSpec) -> Path:
    """The weights file in the cache, downloaded there first when it is not yet."""
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
                f"change the cache folder), or {_without_pretrained(spec)}",
            ) from exc
    return path


def _load_pretrained_state(path: Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The tensors in a weights file, read as data (weights_only): such a file never runs code."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError) as exc:
        # A truncated download, another format, or a pickle that wants to run code.
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise _unexpected_weights(
            path, spec, f"it cannot be read as PyTorch weights ({first_line})"
        ) from exc
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise _unexpected_weights(path, spec, "it holds no mapping of parameter names to tensors")
    return state


# torchvision's DenseNet files predate '.'-free module names: their dense layers have keys
# 'norm.1', 'conv.1', 'norm.2', 'conv.2' where the network has 'norm1', 'conv1', ... This is the
# pattern (and renaming) of torchvision.models.densenet._load_state_dict, which we cannot call:
# it loads with check_hash and without weights_only.
_OLD_DENSENET_KEY = re.compile(
    r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|running_var))$"
)


def _rename_densenet_keys(state: dict[str, torch.Tensor]) -> None:
    """Rename the old DenseNet keys in place, as torchvision does when it loads these files."""
    for key in list(state):
        match = _OLD_DENSENET_KEY.match(key)
        if match:
            state[match.group(1) + match.group(2)] = state.pop(key)


def _load_into(
    model: nn.Module, state: dict[str, torch.Tensor], path: Path, spec: ModelSpec
) -> None:
    """Load every tensor of the file, or refuse the file naming what does not fit."""
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a tensor of another shape: the first such line says which
        problems = [line.strip() for line in str(exc).splitlines()[1:] if line.strip()]
        raise _unexpected_weights(
            path, spec, f"a tensor has another shape ({problems[0] if problems else exc})"
        ) from exc
    problems = []
    if result.missing_keys:
        problems.append(f"{len(result.missing_keys)} missing, e.g. {result.missing_keys[0]!r}")
    if result.unexpected_keys:
        problems.append(
            f"{len(result.unexpected_keys)} unexpected, e.g. {result.unexpected_keys[0]!r}"
        )
    if problems:
        raise _unexpected_weights(path, spec, f"its parameter names differ: {'; '.join(problems)}")


def _unexpected_weights(path: Path, spec: ModelSpec, why: str) -> InvalidModelDirectoryError:
    return InvalidModelDirectoryError(
        f"{path} is not the pretrained weights file torchvision publishes for {spec.arch}: {why}.",
        f"Delete {path}: the next run downloads it again (or copy the published file there), "
        f"or {_without_pretrained(spec)}",
    )


def _without_pretrained(spec: ModelSpec) -> str:
    return (
        "start without pretrained weights: "
        f"`imageops model build DEST --name {spec.arch} --no-pretrained` "
        "(in params.yaml: `pretrained: false` under `model`)."
    )
