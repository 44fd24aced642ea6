"""Evaluate's decision support: ROC and PR areas as scikit-learn computes them, calibration and
the most confidently wrong images (the files `imageops evaluate` writes: tests/test_evaluate.py)."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import average_precision_score, roc_auc_score

from tasks.inference.error_analysis import (
    GALLERY_IMAGES,
    ScoreSample,
    analyse,
    average_precision,
    roc_auc,
)


@pytest.mark.parametrize("decimals", [None, 1])  # 1: many tied scores
def test_areas_are_scikit_learns(decimals: int | None) -> None:
    rng = np.random.default_rng(0)
    positive = rng.random(300) < 0.3
    scores = rng.random(300) + 0.4 * positive
    if decimals is not None:
        scores = np.round(scores, decimals)
    assert roc_auc(scores, positive) == pytest.approx(roc_auc_score(positive, scores))
    assert average_precision(scores, positive) == pytest.approx(
        average_precision_score(positive, scores)
    )
    assert np.isnan(roc_auc(scores, np.zeros(300, bool)))  # no positive row: no area
    assert np.isnan(average_precision(scores, np.zeros(300, bool)))


def test_calibration_and_the_most_confidently_wrong_across_chunks() -> None:
    classes = ["a", "b"]
    sample = ScoreSample(classes)
    # chunk 1: confident and right, confident and wrong; chunk 2: unsure rows, one wrong
    sample.add(np.array([[0.95, 0.05], [0.9, 0.1]]), np.array(["a", "b"]), ["1", "2"],
               np.array(["a", "a"]))  # fmt: skip
    sample.add(np.array([[0.55, 0.45], [0.4, 0.6], [0.52, 0.48]]), np.array(["a", "b", "b"]),
               ["3", "4", "5"], np.array(["a", "b", "a"]))  # fmt: skip
    result = analyse(sample)
    # Bins of width 1/15: each of the five confidences (0.95, 0.9, 0.55, 0.6, 0.52) is alone in
    # its bin, so ECE is the mean of |right (1) or wrong (0) - confidence|.
    expected = 0.05 + 0.9 + 0.45 + 0.4 + 0.52
    assert result.ece == pytest.approx(expected / 5)
    assert sum(b["rows"] for b in result.bins) == 5
    assert [(w.path, w.truth, w.predicted) for w in result.wrong] == [
        ("2", "b", "a"),
        ("5", "b", "a"),
    ]
    assert result.wrong[0].confidence == pytest.approx(0.9)
    many = ScoreSample(classes)
    for chunk in range(3):  # more wrong rows than the gallery shows: the most confident stay
        conf = np.linspace(0.5, 0.99, 10) - chunk * 0.001
        many.add(np.c_[conf, 1 - conf], np.array(["b"] * 10), [f"{chunk}-{i}" for i in range(10)],
                 np.array(["a"] * 10))  # fmt: skip
    kept = many.most_confidently_wrong()
    assert len(kept) == GALLERY_IMAGES
    assert [w.confidence for w in kept] == sorted((w.confidence for w in kept), reverse=True)
    assert kept[0].path == "0-9"
    big = ScoreSample(classes)  # one chunk with more wrong rows than the gallery shows
    conf = np.random.default_rng(2).uniform(0.5, 1.0, 40)
    big.add(np.c_[conf, 1 - conf], np.array(["b"] * 40), [str(i) for i in range(40)],
            np.array(["a"] * 40))  # fmt: skip
    top = sorted(range(40), key=lambda i: -conf[i])[:GALLERY_IMAGES]
    assert [w.path for w in big.most_confidently_wrong()] == [str(i) for i in top]


def test_gradcam_points_at_what_raised_the_predicted_class() -> None:
    """A network whose class 0 is the mean brightness of its one feature map (the red channel,
    through a 1x1 convolution): the gradient weights that map positively, so the map of class 0
    is the image itself, brightest in the square that was lit. A network without a spatial map (a
    vision transformer whose input is one patch) gets no picture rather than a wrong one."""
    import torch
    from torch import nn

    from tasks.inference.gradcam import class_activation

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 1, 1, bias=False)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor([1.0, 0.0, 0.0]).view(1, 3, 1, 1))
    head = nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0], [-1.0]]))
    model = nn.Sequential(conv, nn.AdaptiveAvgPool2d(1), nn.Flatten(), head).eval()
    image = torch.zeros(1, 3, 16, 16)
    image[0, 0, 2:6, 10:14] = 1.0  # a red square, top right
    cam = class_activation(model, image, 0)
    assert cam is not None and cam.shape == (16, 16)
    peak = np.unravel_index(cam.argmax(), cam.shape)
    assert 2 <= peak[0] < 6 and 10 <= peak[1] < 14
    assert cam.max() == pytest.approx(1.0) and cam[12:, :4].max() == 0  # dark corner: nothing
    # Class 1 falls as the square brightens: no positive evidence anywhere.
    assert class_activation(model, image, 1).max() == 0

    import torchvision

    vit = torchvision.models.vit_b_32(image_size=32, num_classes=2).eval()
    assert class_activation(vit, torch.zeros(1, 3, 32, 32), 0) is None
