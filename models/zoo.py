"""The model zoo: torchvision's classification networks (the Azure design's DenseNet and ResNet
among them) and timm's, built with a head for our classes.

The components' options and the UntrainedModelDirectory they write are in
:mod:`models.untrained` (no torch there); this module builds the network from them
(:func:`build_model`), with the published pretrained weights when asked (read and checked in
:mod:`models.pretrained`), and says what input those weights expect (:func:`preprocessing`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torchvision
from torch import nn

from models.errors import ImageOpsError, InvalidModelDirectoryError
from models.pretrained import (
    PretrainedWeightsMissingError,
    load_into,
    load_torchvision_state,
    timm,
    timm_model_name,
    timm_pretrained_cfg,
    timm_weights_file,
    torchvision_weights_file,
    unexpected_weights,
)
from models.transform_spec import IMAGENET_MEAN, IMAGENET_STD
from models.untrained import FAMILIES, ModelSpec

__all__ = [
    "NETWORKS",
    "Network",
    "Preprocessing",
    "PretrainedWeightsMissingError",
    "build_model",
    "head_parameters",
    "network_for",
    "preprocessing",
    "transform_fields",
]


class InputSizeError(ImageOpsError):
    """The transform's input size does not fit the network (too small, or not the one it needs)."""


@dataclass(frozen=True)
class Preprocessing:
    """The input a network's pretrained weights expect: what its transform should be."""

    resize_size: int  # shorter side after resizing
    crop_size: int  # side of the center crop: the network's input
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str  # "bilinear" or "bicubic" (ours is always bilinear; see docs/training.md)


class Network:
    """How the networks of one family are built from torchvision: options, weights, head.

    A family with its own needs overrides :meth:`fix_state` (old key names in its files).
    """

    def options(self, spec: ModelSpec, size: int | None) -> dict[str, object]:
        """The builder's keyword arguments: the family's switch, and what the weights or the
        input size fix (torchvision's builders set these when they load weights themselves)."""
        switch = FAMILIES[spec.family].switch
        options: dict[str, object] = {switch: getattr(spec, switch)} if switch else {}
        weights = torchvision.models.get_model_weights(spec.arch).DEFAULT
        min_side = weights.meta["min_size"][0]
        if spec.arch.startswith("vit_") and not spec.pretrained:
            # A vision transformer from scratch takes any multiple of its patch: its position
            # embeddings are made for the transform's size.
            patch = int(spec.arch.rsplit("_", 1)[1])
            if size is not None and size % patch:
                raise InputSizeError(
                    f"{spec.arch} cuts its input into {patch}x{patch} patches; the transform "
                    f"gives {size}x{size}, which is not a multiple of {patch}.",
                    f"Crop to a multiple of {patch} (e.g. {max(patch, size // patch * patch)}).",
                )
            options["image_size"] = size or min_side
            min_side = patch
        if spec.arch.startswith("maxvit_") and not spec.pretrained and size is not None:
            options["input_size"] = (size, size)  # its attention grids follow the input
        if spec.pretrained and spec.arch.startswith(("vit_", "maxvit_")):
            # Position embeddings (ViT) and attention grids (MaxViT) of the weights' one size.
            if size is not None and size != min_side:
                raise InputSizeError(
                    f"{spec.arch}'s pretrained weights take {min_side}x{min_side} pixels only; "
                    f"the transform gives {size}x{size}.",
                    f"Use the weights' transform: `imageops transform init DEST --like-model "
                    f"{spec.arch}`, or train without pretrained weights.",
                )
            key = "image_size" if spec.arch.startswith("vit_") else "input_size"
            options[key] = min_side if key == "image_size" else (min_side, min_side)
        if size is not None and size < min_side:
            raise InputSizeError(
                f"{spec.arch} needs an input of at least {min_side}x{min_side} pixels; the "
                f"transform gives {size}x{size}.",
                f"Crop larger (center_crop_size >= {min_side}) or choose another network.",
            )
        if spec.arch in ("googlenet", "inception_v3"):
            # Their weights were trained on another normalisation (transform_input converts) and
            # hold the auxiliary heads, which we drop after loading (see drop_extras).
            options |= {"aux_logits": spec.pretrained, "init_weights": not spec.pretrained}
            options["transform_input"] = spec.pretrained
        return options

    def check(self, spec: ModelSpec, size: int) -> None:
        """Refuse an input of ``size`` pixels the network cannot take (before any build)."""
        self.options(spec, size)

    def fix_state(self, state: dict[str, torch.Tensor]) -> None:
        """Adapt a published weights file's keys to the network's, in place."""

    def head_name(self, model: nn.Module) -> str:
        """The dotted name of the classification layer: the last ``nn.Linear`` registered (every
        torchvision classifier ends in one), or the last convolution (SqueezeNet's head)."""
        for kind in (nn.Linear, nn.Conv2d):
            names = [name for name, module in model.named_modules() if isinstance(module, kind)]
            if names:
                return names[-1]
        raise InvalidModelDirectoryError(f"{type(model).__name__} has no classification layer.")

    def drop_extras(self, model: nn.Module) -> None:
        """Remove what the weights needed but training does not: Inception's auxiliary heads."""
        if getattr(model, "aux_logits", False):
            model.aux_logits = False
            for name in ("AuxLogits", "aux1", "aux2"):
                if hasattr(model, name):
                    setattr(model, name, None)

    def build(self, spec: ModelSpec, num_classes: int, size: int | None, load: bool) -> nn.Module:
        """The network; with ``load``, the published weights under a new head."""
        options = self.options(spec, size)
        if not spec.pretrained:
            return torchvision.models.get_model(
                spec.arch, weights=None, num_classes=num_classes, **options
            )
        model = torchvision.models.get_model(spec.arch, weights=None, **options)
        if load:
            path = torchvision_weights_file(spec)
            state = load_torchvision_state(path, spec)
            self.fix_state(state)
            load_into(model, state, path, spec)
        self.drop_extras(model)
        self.replace_head(model, num_classes)
        return model

    def replace_head(self, model: nn.Module, num_classes: int) -> None:
        name = self.head_name(model)
        parent, _, leaf = name.rpartition(".")
        old = model.get_submodule(name)
        if isinstance(old, nn.Linear):
            new: nn.Module = nn.Linear(old.in_features, num_classes)
        else:  # SqueezeNet: a 1x1 convolution per class, then average pooling
            new = nn.Conv2d(old.in_channels, num_classes, old.kernel_size)
        setattr(model.get_submodule(parent), leaf, new)

    def head(self, model: nn.Module) -> nn.Module:
        return model.get_submodule(self.head_name(model))

    def preprocessing(self, spec: ModelSpec) -> Preprocessing:
        """The input torchvision's default weights for ``spec.arch`` were trained and rated on."""
        weights = torchvision.models.get_model_weights(spec.arch).DEFAULT
        given = weights.transforms.keywords  # torchvision's ImageClassification(...) arguments
        return Preprocessing(
            resize_size=given.get("resize_size", 256),
            crop_size=given["crop_size"],
            mean=tuple(given.get("mean", IMAGENET_MEAN)),
            std=tuple(given.get("std", IMAGENET_STD)),
            interpolation=str(getattr(given.get("interpolation"), "value", "bilinear")),
        )


# torchvision's DenseNet files predate '.'-free module names: their dense layers have keys
# 'norm.1', 'conv.1', 'norm.2', 'conv.2' where the network has 'norm1', 'conv1', ... This is the
# pattern (and renaming) of torchvision.models.densenet._load_state_dict, which we cannot call:
# it loads with check_hash and without weights_only.
_OLD_DENSENET_KEY = re.compile(
    r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|running_var))$"
)


class DenseNetNetwork(Network):
    def fix_state(self, state: dict[str, torch.Tensor]) -> None:
        """Rename the old DenseNet keys in place, as torchvision does when it loads these files."""
        for key in list(state):
            match = _OLD_DENSENET_KEY.match(key)
            if match:
                state[match.group(1) + match.group(2)] = state.pop(key)


class TimmNetwork(Network):
    """timm's models (``timm/<name>``): timm builds them and loads its hub weights; the weights'
    ``pretrained_cfg`` says their input."""

    def build(self, spec: ModelSpec, num_classes: int, size: int | None, load: bool) -> nn.Module:
        name = timm_model_name(spec)
        overlay = None
        if spec.pretrained and load:
            overlay = {"file": str(timm_weights_file(spec))}
        try:
            # pretrained with a file: timm reads it (safetensors, or torch.load weights_only)
            # and drops its ImageNet head for ours.
            return timm().create_model(
                name,
                pretrained=overlay is not None,
                num_classes=num_classes,
                pretrained_cfg_overlay=overlay,
            )
        except (RuntimeError, OSError, ValueError, KeyError) as exc:
            if overlay is None:
                raise
            raise unexpected_weights(overlay["file"], spec, str(exc).splitlines()[0]) from exc

    def check(self, spec: ModelSpec, size: int) -> None:
        timm_model_name(spec)  # the name, refused naming similar ones; sizes are timm's to check

    def head(self, model: nn.Module) -> nn.Module:
        return model.get_classifier()

    def preprocessing(self, spec: ModelSpec) -> Preprocessing:
        cfg = timm().data.resolve_data_config({}, pretrained_cfg=timm_pretrained_cfg(spec))
        crop = cfg["input_size"][-1]
        return Preprocessing(
            resize_size=math.floor(crop / cfg["crop_pct"]),  # as timm's eval transform does
            crop_size=crop,
            mean=tuple(cfg["mean"]),
            std=tuple(cfg["std"]),
            interpolation=cfg["interpolation"],
        )


# One entry per models.untrained.FAMILIES entry.
NETWORKS: dict[str, Network] = {
    "densenet": DenseNetNetwork(),
    "resnet": Network(),
    "torchvision": Network(),
    "timm": TimmNetwork(),
}


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
    return {id(p) for p in network_for(spec).head(model).parameters()}


def preprocessing(spec: ModelSpec) -> Preprocessing:
    """The input ``spec``'s pretrained weights expect (size, crop, mean, std), from torchvision's
    weights metadata or timm's ``pretrained_cfg``."""
    return network_for(spec).preprocessing(spec)


def transform_fields(spec: ModelSpec) -> dict[str, object]:
    """The TransformSpec fields that give ``spec``'s pretrained weights their input: the resize,
    every crop at the weights' size (so training and inference feed it that size), mean, std."""
    seen = preprocessing(spec)
    crop = seen.crop_size
    return {
        "resize_size": seen.resize_size,
        "center_crop_size": crop,
        "random_crop_size": crop,
        "random_resized_crop_size": crop,
        "mean": list(seen.mean),
        "std": list(seen.std),
    }


def build_model(
    spec: ModelSpec, num_classes: int, input_size: int | None = None, *, load_weights: bool = True
) -> nn.Module:
    """Build the network for ``spec`` with a ``num_classes``-way head.

    Pretrained weights are the published files, read from the cache under ``TORCH_HOME``
    (torchvision's at ``<TORCH_HOME>/hub/checkpoints/<file>``, timm's in the Hugging Face hub
    layout under ``<TORCH_HOME>/hub/huggingface``) and downloaded there when the network allows;
    the ImageNet head is then replaced by a fresh one for our classes. ``input_size``: the side
    of the transform's input, checked against what the network takes (and the size of a vision
    transformer trained from scratch). ``load_weights=False`` builds the same network without
    reading weights: a trained model's own replace them.
    """
    return network_for(spec).build(spec, num_classes, input_size, load_weights)
