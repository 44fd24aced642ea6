"""Grad-CAM (Selvaraju et al., 2017) on the most confidently wrong images: where the network looked
when it chose the wrong class.

For each image, the gradient of the predicted class's score with respect to the network's last
spatial feature map (the last module output of shape N x C x H x W with H x W > 1, found in the
forward pass, so any convolutional network of the zoo works without naming a layer) weights that
map's channels; their ReLU'd sum, upsampled to the input, is drawn over the image the network
saw. For a vision transformer the last such map is its patch embedding (gradient times input, a
patch at a time: coarser than a convolutional network's); a network without one gets no picture.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tasks.inference.error_analysis import WrongImage, figure_of, save_grid, title_tile
from tasks.shared.step import step_logger

if TYPE_CHECKING:
    import torch
    from torch import nn

GRADCAM_IMAGES = 8  # the most confidently wrong images explained (a backward pass each)


class _LastFeatureMap:
    """Forward hooks on every module that keep the last 4-D output with a spatial extent."""

    def __init__(self, model: nn.Module) -> None:
        self.output: torch.Tensor | None = None
        self.handles = [m.register_forward_hook(self._seen) for m in model.modules()]

    def _seen(self, module: nn.Module, inputs: object, output: object) -> None:
        import torch

        if isinstance(output, torch.Tensor) and output.dim() == 4 and output.shape[-2:].numel() > 1:
            self.output = output

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def class_activation(model: nn.Module, batch: torch.Tensor, class_index: int) -> np.ndarray | None:
    """Grad-CAM of ``class_index`` for one image (``batch`` 1 x 3 x H x W): an H x W map in [0, 1],
    or None when the network has no spatial feature map."""
    import torch

    hooks = _LastFeatureMap(model)
    try:
        with torch.enable_grad():
            batch = batch.clone().requires_grad_(True)  # gradients flow even through frozen layers
            logits = model(batch)
            features = hooks.output
            if features is None:
                return None
            (gradients,) = torch.autograd.grad(logits[0, class_index], features)
    finally:
        hooks.close()
    weights = gradients.mean(dim=(2, 3), keepdim=True)
    cam = torch.relu((weights * features).sum(dim=1, keepdim=True))
    cam = torch.nn.functional.interpolate(
        cam, size=batch.shape[-2:], mode="bilinear", align_corners=False
    )[0, 0]
    cam = cam.detach().float()
    top = float(cam.max())
    return (cam / top).numpy() if top > 0 else cam.numpy()


def gradcam_png(wrong: list[WrongImage], images: Path, model_dir: Path, path: Path) -> Path | None:
    """Grad-CAM of the predicted class over the first ``GRADCAM_IMAGES`` of ``wrong`` (most
    confident first), as a grid of tiles; None (nothing written) when the network has no spatial
    feature map. An image that cannot be read is a tile with its reason."""
    import torch

    from models.directory import load_model_directory
    from tasks.data.imagedir import load_rgb
    from tasks.data.transform import applied_to, transform_for

    model, info = load_model_directory(model_dir)
    transform = transform_for(info.transform, "inference", images, applied_to(images))
    mean = torch.tensor(info.transform.mean).view(3, 1, 1)
    std = torch.tensor(info.transform.std).view(3, 1, 1)
    index = {name: i for i, name in enumerate(info.classes)}
    shown = [w for w in wrong if w.predicted in index][:GRADCAM_IMAGES]
    if not shown:
        return None
    columns = 4
    rows = -(-len(shown) // columns)
    figure = figure_of(2.4 * columns, 2.6 * rows)
    axes = np.atleast_1d(figure.subplots(rows, columns)).ravel()
    for tile, item in zip(axes, shown, strict=False):
        try:
            batch = transform(load_rgb(images / item.path)).unsqueeze(0)
        except Exception as exc:  # a tile must not sink the evaluation
            tile.text(0.5, 0.5, type(exc).__name__, ha="center", va="center")
        else:
            cam = class_activation(model, batch, index[item.predicted])
            if cam is None:
                step_logger(__name__).info(
                    "No Grad-CAM for %s: the network has no spatial feature map.",
                    info.architecture.arch,
                )
                return None
            seen = (batch[0] * std + mean).clamp(0, 1).permute(1, 2, 0).numpy()
            tile.imshow(seen)
            tile.imshow(cam, cmap="jet", alpha=0.45, vmin=0, vmax=1)
        title_tile(tile, item)
    return save_grid(figure, axes, "Grad-CAM of the predicted class (true -> predicted)", path)
