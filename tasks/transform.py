"""Image transformations, defined once: training, evaluation, export and scoring all use these.

The network sees exactly what :func:`eval_transform` makes of an image, whether the image comes
from the training loop, the ONNX parity check or the batch scorer, so scoring cannot drift from
training.
"""

from __future__ import annotations

import torch
from torchvision.transforms import v2

from models.directory import Preprocessing


def eval_transform(pre: Preprocessing) -> v2.Compose:
    """Deterministic: resize, center crop, scale to [0, 1], normalise."""
    return v2.Compose(
        [
            v2.ToImage(),
            v2.Resize(pre.resize, antialias=True),
            v2.CenterCrop(pre.center_crop),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=pre.mean, std=pre.std),
        ]
    )


def train_transform(pre: Preprocessing, horizontal_flip: bool = False) -> v2.Compose:
    """The evaluation transform plus the random augmentations asked for."""
    steps: list[v2.Transform] = [v2.ToImage(), v2.Resize(pre.resize, antialias=True)]
    steps.append(v2.CenterCrop(pre.center_crop))
    if horizontal_flip:
        steps.append(v2.RandomHorizontalFlip())
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean=pre.mean, std=pre.std)]
    return v2.Compose(steps)
