"""Named training recipes: the values a training request leaves empty, filled in once at launch.

``azure`` is the Azure design's Train PyTorch Model, exact, and the default. ``modern`` is a
recipe for small data sets from scratch and for fine-tuning, after torchvision's "How to train
state-of-the-art models" and timm's small-data settings: AdamW, cosine decay after a warm-up
epoch, label smoothing, no weight decay on normalisation layers and biases, and RandAugment with
random erasing in training (the transform's empty augmentation fields). Any field a request sets
keeps its value; the run records every value it resolved to (MLflow params, ``model.json``).
Details: docs/training.md#recipes.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from models.transform_spec import TransformSpec

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
# What each recipe gives the TransformSpec fields a transform leaves empty (None).
AUGMENTATION: dict[str, dict[str, Any]] = {
    "azure": {"augmentation": "none", "random_erasing": False, "random_erasing_probability": 0.5},
    "modern": {
        "random_erasing": True,
        "augmentation": "randaugment",
        "augmentation_magnitude": 7,
        "random_erasing_probability": 0.25,
    },
}


def filled(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each empty (None) field that ``defaults`` has taken from there."""
    return {k: defaults[k] if v is None and k in defaults else v for k, v in values.items()}


def resolve_transform(spec: TransformSpec, recipe: Recipe) -> TransformSpec:
    """``spec`` with the recipe's augmentation where it leaves its fields empty."""
    return TransformSpec.model_validate(filled(spec.model_dump(), AUGMENTATION[recipe]))
