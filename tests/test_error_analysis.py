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
