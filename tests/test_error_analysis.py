"""Evaluate's decision support: ROC and PR areas as scikit-learn computes them, calibration, the
most confidently wrong images; and the files `imageops evaluate` writes from them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from projects import imageops
from sklearn.metrics import average_precision_score, roc_auc_score

from tasks.inference.error_analysis import (
    GALLERY_IMAGES,
    ScoreSample,
    analyse,
    average_precision,
    roc_auc,
)

pytest_plugins = ["model_fixtures"]


@pytest.fixture(scope="module")
def scored_val_table(
    exported_model: Path, digits_split: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The validation digits scored by the session model (CSV). Do not modify."""
    from tasks.inference.score import score

    return score(exported_model, digits_split[1], tmp_path_factory.mktemp("scored") / "val.csv")


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


def test_imageops_evaluate_draws_the_curves_calibration_and_gallery(
    scored_val_table: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    scored = tmp_path / "val.csv"
    scored.write_bytes(scored_val_table.read_bytes())
    result = imageops("evaluate", str(scored), "--images", str(digits_split[1]), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "roc_auc_macro:" in result.stdout and "ece:" in result.stdout
    metrics = json.loads((tmp_path / "val.metrics.json").read_text())
    assert 0.5 < metrics["roc_auc_macro"] <= 1 and 0 <= metrics["ece"] <= 1
    per_class = json.loads((tmp_path / "val.per_class.json").read_text())
    assert all(0 <= row["roc_auc"] <= 1 and 0 <= row["pr_auc"] <= 1 for row in per_class)
    bins = json.loads((tmp_path / "val.calib.json").read_text())
    assert sum(b["rows"] for b in bins) == metrics["images"]
    for name in ("val.roc_pr.png", "val.calib.png", "val.confusion.png"):
        with Image.open(tmp_path / name) as picture:
            assert picture.width > 300, name
    if metrics["accuracy"] < 1:  # the session model gets some wrong: they are drawn
        with Image.open(tmp_path / "val.wrong.png") as gallery:
            assert gallery.width > 300
    without = imageops("evaluate", str(scored), cwd=tmp_path)  # no --images: no gallery
    assert without.returncode == 0, without.stderr
