"""Named training recipes: the values a training request leaves empty, filled in once at launch.

``modern``, the default, is a recipe for small data sets from scratch and for fine-tuning, after
torchvision's "How to train state-of-the-art models" and timm's small-data settings: AdamW,
cosine decay after a warm-up epoch, label smoothing, no weight decay on normalisation layers and
biases, and in training RandAugment, random erasing and a random resized crop (the transform's
empty augmentation and geometry fields). It measured best on held-out data (docs/benchmarks.md).
``azure`` is the Azure design's Train PyTorch Model, exact. Any field a request sets keeps its
value; the run records every value it resolved to (MLflow params, ``model.json``).
Details: docs/training.md#recipes.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from models.transform_spec import RRC_SCALE, RRC_SIZE, TransformSpec

Recipe = Literal["azure", "modern"]
RECIPES: tuple[str, ...] = get_args(Recipe)
# The learning-rate schedules (tasks.train.schedule), named here so the request needs no torch.
Schedule = Literal["poly", "cosine", "step", "onecycle"]

# What each recipe gives the TrainParams fields a request leaves empty (None): Azure's
# component, and what modern changes of it.
AZURE: dict[str, Any] = {
    "optimizer": "sgd",
    "schedule": "poly",
    "learning_rate": 0.001,
    "momentum": 0.9,
    "weight_decay": 1e-4,
    "warmup_epochs": 0,
    "label_smoothing": 0.0,
    "decay_norm_and_bias": True,
    "mixup_alpha": 0.0,
    "cutmix_alpha": 0.0,
    "clip_grad_norm": 0.0,
    "accumulation_steps": 1,
    "ema_decay": 0.0,
    "class_weights": "none",
    "head_only_epochs": 0,
    "backbone_lr_scale": 1.0,
}
TRAINING: dict[str, dict[str, Any]] = {
    "azure": AZURE,
    "modern": AZURE
    | {
        "optimizer": "adamw",  # momentum (0.9) is its beta1
        "schedule": "cosine",
        "weight_decay": 0.05,
        "warmup_epochs": 1,
        "label_smoothing": 0.1,
        "decay_norm_and_bias": False,
        # MixUp and CutMix stay off: short runs on small data learn slower with them.
    },
}
# What each recipe changes when the network starts from pretrained weights: modern trains the new
# head alone for an epoch (a random head's first gradients would wreck the features), then the
# whole network with the backbone at a tenth of the head's rate (fastai's fine_tune, timm's and
# torchvision's fine-tuning practice: the features need nudging, the head learning).
FINE_TUNING: dict[str, dict[str, Any]] = {
    "azure": {},
    "modern": {"head_only_epochs": 1, "backbone_lr_scale": 0.1},
}
# What each recipe gives the TransformSpec fields a transform leaves empty (None); modern's
# random resized crop depends on the spec (:func:`geometry`).
AUGMENTATION: dict[str, dict[str, Any]] = {
    "azure": {
        "augmentation": "none",
        "random_erasing": False,
        "random_erasing_probability": 0.5,
        "random_resized_crop": False,
        "random_resized_crop_size": RRC_SIZE,
        "random_resized_crop_scale": RRC_SCALE,
    },
    "modern": {
        "random_erasing": True,
        "augmentation": "randaugment",
        "random_erasing_probability": 0.25,
        "random_resized_crop_scale": 0.5,
    },
}


def geometry(spec: TransformSpec, recipe: Recipe) -> dict[str, Any]:
    """The random resized crop ``recipe`` gives ``spec`` where its fields are empty.

    azure: Azure's (off; 256 px and 8% when switched on). modern: on, unless the spec crops at
    random already (random crop), at the side of the crop the spec gives otherwise (center crop,
    else resize), so training crops at the size inference sees: a random area of half the
    image to all of it (on the held-out fonts, 97% top-1 where the center crop alone gave 93.5 to
    95%: docs/benchmarks.md). A spec without any crop gets none (it has no input size).
    """
    if recipe == "azure":
        return {}
    side = spec.model_copy(update={"random_resized_crop": False}).crop_side()
    on = not spec.random_crop and side is not None
    return {"random_resized_crop": on, "random_resized_crop_size": side or RRC_SIZE}


# RandAugment's magnitude in the modern recipe: timm's rand-m7 on torchvision's scale (timm counts
# to 10, torchvision to 30). On the held-out fonts of bench/accuracy.py it gave 60% top-1 where
# torchvision's magnitude 7 gave 33 to 44%. Another policy a spec names keeps its own default
# (AugMix's severity is not on this scale).
RANDAUGMENT_MAGNITUDE = 21


def policy_strength(spec: TransformSpec, recipe: Recipe) -> dict[str, Any]:
    """The magnitude ``recipe`` gives ``spec``'s augmentation policy where it is empty."""
    policy = spec.augmentation or AUGMENTATION[recipe].get("augmentation")
    if recipe == "modern" and policy == "randaugment":
        return {"augmentation_magnitude": RANDAUGMENT_MAGNITUDE}
    return {}


def filled(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each empty (None) field that ``defaults`` has taken from there."""
    return {k: defaults[k] if v is None and k in defaults else v for k, v in values.items()}


def resolve_transform(spec: TransformSpec, recipe: Recipe) -> TransformSpec:
    """``spec`` with the recipe's augmentation and geometry where it leaves its fields empty."""
    defaults = AUGMENTATION[recipe] | geometry(spec, recipe) | policy_strength(spec, recipe)
    return TransformSpec.model_validate(filled(spec.model_dump(), defaults))
