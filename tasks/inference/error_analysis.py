"""Evaluate's pictures and what supports a decision beyond accuracy: the confusion matrix,
per-class ROC and PR curves with their areas (one class against the rest), calibration (expected
calibration error and a reliability diagram), and the most confidently wrong images as a gallery.

Computed from the scored table's probabilities, gathered a chunk at a time by evaluate
(:class:`ScoreSample`): float32 and a class id per row, about 44 bytes a row for 10 classes.
The areas are scikit-learn's definitions (``roc_auc_score`` and ``average_precision_score`` one
vs rest; tests/test_error_analysis.py holds them to it) in numpy: importing scikit-learn cost
more than a second of every `imageops evaluate`. Details: docs/internals.md#evaluation.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from models.atomic import atomic_file
from tasks.data.imageformat import visible_name

if TYPE_CHECKING:  # matplotlib is imported where a picture is drawn
    from matplotlib.figure import Figure

CALIBRATION_BINS = 15  # equal-width confidence bins, as in Guo et al. (2017)
GALLERY_IMAGES = 16  # the most confidently wrong images shown


@dataclass(order=True)
class WrongImage:
    """A misclassified image, ordered by the confidence of its wrong answer."""

    confidence: float
    path: str = field(compare=False)
    truth: str = field(compare=False)
    predicted: str = field(compare=False)


@dataclass
class ScoreSample:
    """The probabilities and true classes of a scored table's scored rows, gathered by chunk, and
    its ``GALLERY_IMAGES`` most confidently wrong rows (a heap: memory stays small)."""

    classes: list[str]
    probs: list[np.ndarray] = field(default_factory=list)
    truth: list[np.ndarray] = field(default_factory=list)  # class ids; -1: a class not scored
    wrong: list[WrongImage] = field(default_factory=list)

    def add(
        self, probs: np.ndarray, truth: np.ndarray, paths: list[str], predicted: np.ndarray
    ) -> None:
        """One chunk: ``probs`` (rows x classes), true class names, paths, predicted names."""
        index = {c: i for i, c in enumerate(self.classes)}
        self.probs.append(probs.astype(np.float32))
        self.truth.append(np.array([index.get(t, -1) for t in truth], dtype=np.int32))
        confidence = probs.max(axis=1) if len(probs) else np.zeros(0)
        wrong = np.flatnonzero(truth != predicted)
        if len(wrong) > GALLERY_IMAGES:  # only a chunk's most confident can enter the gallery
            wrong = wrong[np.argpartition(-confidence[wrong], GALLERY_IMAGES)[:GALLERY_IMAGES]]
        for row in wrong:
            item = WrongImage(float(confidence[row]), paths[row], truth[row], predicted[row])
            if len(self.wrong) < GALLERY_IMAGES:
                heapq.heappush(self.wrong, item)
            elif item > self.wrong[0]:
                heapq.heapreplace(self.wrong, item)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.probs:
            return np.zeros((0, len(self.classes)), np.float32), np.zeros(0, np.int32)
        return np.concatenate(self.probs), np.concatenate(self.truth)

    def most_confidently_wrong(self) -> list[WrongImage]:
        return sorted(self.wrong, reverse=True)


def _binary_curve(scores: np.ndarray, positive: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """True and false positives at each distinct threshold, highest first (scikit-learn's
    ``_binary_clf_curve``)."""
    order = np.argsort(-scores, kind="mergesort")
    scores, positive = scores[order], positive[order]
    last = np.r_[np.flatnonzero(np.diff(scores)), len(scores) - 1]
    tps = np.cumsum(positive)[last].astype(np.float64)
    return tps, 1.0 + last - tps


def roc_auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """Area under the ROC curve (ties counted half); NaN when one side has no rows."""
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    if not n_pos or not n_neg:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2.0)[inverse]  # average ranks, from 1
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def average_precision(scores: np.ndarray, positive: np.ndarray) -> float:
    """Area under the precision-recall curve as a step sum; NaN without positive rows."""
    if not positive.any():
        return float("nan")
    tps, fps = _binary_curve(scores, positive)
    precision = tps / (tps + fps)
    recall = tps / tps[-1]
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


@dataclass(frozen=True)
class Analysis:
    """Per-class areas, calibration, and what the pictures are drawn from."""

    roc_auc: list[float]  # per class, one vs rest
    pr_auc: list[float]
    ece: float
    bins: list[dict[str, float]]  # per confidence bin: its range, rows, accuracy, confidence
    wrong: list[WrongImage]

    def macro(self, values: list[float]) -> float:
        """Mean over the classes that have an area (a class without rows has none)."""
        finite = [v for v in values if np.isfinite(v)]
        return float(np.mean(finite)) if finite else float("nan")


def analyse(sample: ScoreSample) -> Analysis:
    probs, truth = sample.arrays()
    classes = range(len(sample.classes))
    roc = [roc_auc(probs[:, c], truth == c) for c in classes]
    pr = [average_precision(probs[:, c], truth == c) for c in classes]
    confidence = probs.max(axis=1) if len(probs) else np.zeros(0)
    correct = probs.argmax(axis=1) == truth if len(probs) else np.zeros(0, bool)
    edges = np.linspace(0.0, 1.0, CALIBRATION_BINS + 1)
    which = np.clip(np.searchsorted(edges, confidence, side="right") - 1, 0, CALIBRATION_BINS - 1)
    bins, ece = [], 0.0
    for b in range(CALIBRATION_BINS):
        inside = which == b
        rows = int(inside.sum())
        accuracy = float(correct[inside].mean()) if rows else float("nan")
        mean_confidence = float(confidence[inside].mean()) if rows else float("nan")
        if rows:
            ece += rows / len(confidence) * abs(accuracy - mean_confidence)
        bins.append({"low": float(edges[b]), "high": float(edges[b + 1]), "rows": rows,
                     "accuracy": accuracy, "confidence": mean_confidence})  # fmt: skip
    return Analysis(roc, pr, float(ece), bins, sample.most_confidently_wrong())


def confusion_png(labels: list[str], matrix: list[list[int]], path: Path) -> Path:
    """Draw the confusion matrix (rows: true class, columns: predicted) to a PNG, atomically.

    A bare Figure on the Agg canvas, not pyplot: no global figure state and no display needed,
    so it is safe in worker threads and on headless machines.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    data = np.asarray(matrix)
    side = max(4.0, 0.5 * len(labels) + 2.0)
    figure = Figure(figsize=(side, side), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    image = axes.imshow(data, cmap="Blues")
    figure.colorbar(image, ax=axes, fraction=0.046)
    # Class names are folder names: "$x$" is a name, not mathtext (which can fail to parse), and
    # a "\r" in one is drawn as the two characters.
    shown = [visible_name(label) for label in labels]
    axes.set_xticks(range(len(labels)), shown, rotation=45, ha="right", parse_math=False)
    axes.set_yticks(range(len(labels)), shown, parse_math=False)
    axes.set_xlabel("Predicted")
    axes.set_ylabel("True")
    axes.set_title("Confusion matrix")
    if len(labels) <= 30:  # beyond that the numbers are unreadable; the JSON has them
        threshold = data.max() / 2 if data.size else 0
        for (row, col), value in np.ndenumerate(data):
            colour = "white" if value > threshold else "black"
            axes.text(col, row, str(value), ha="center", va="center", color=colour, fontsize=8)
    with atomic_file(path) as tmp:
        figure.savefig(tmp, format="png")
    return path


def figure_of(width: float, height: float) -> Figure:
    """A figure drawn without pyplot (no global state: nothing to close, safe in threads)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _thinned(tps: np.ndarray, fps: np.ndarray, points: int = 400) -> tuple[np.ndarray, ...]:
    """At most ``points`` of a curve's thresholds, the last kept: a curve of 200,000 distinct
    scores drew in seconds, and no screen shows more than a few hundred steps."""
    if len(tps) <= points:
        return tps, fps
    keep = np.unique(np.r_[np.linspace(0, len(tps) - 1, points).astype(int), len(tps) - 1])
    return tps[keep], fps[keep]


def curves_png(sample: ScoreSample, analysis: Analysis, path: Path) -> Path:
    """Each class's ROC curve and PR curve, one vs rest, with its area in the legend."""
    probs, truth = sample.arrays()
    figure = figure_of(11, 5)
    roc_axes, pr_axes = figure.subplots(1, 2)
    for c, name in enumerate(sample.classes):
        positive = truth == c
        if not positive.any() or positive.all():
            continue
        tps, fps = _thinned(*_binary_curve(probs[:, c], positive))
        label = visible_name(name).replace("$", r"\$")  # a class name, never mathtext
        roc_axes.plot(np.r_[0, fps / fps[-1]], np.r_[0, tps / tps[-1]],
                      label=f"{label} ({analysis.roc_auc[c]:.3f})")  # fmt: skip
        pr_axes.step(np.r_[0, tps / tps[-1]], np.r_[1, tps / (tps + fps)], where="post",
                     label=f"{label} ({analysis.pr_auc[c]:.3f})")  # fmt: skip
    roc_axes.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
    roc_axes.set(
        xlabel="False positive rate",
        ylabel="True positive rate",
        title=f"ROC, one vs rest (macro AUC {analysis.macro(analysis.roc_auc):.3f})",
    )
    pr_title = f"Precision-recall (macro AP {analysis.macro(analysis.pr_auc):.3f})"
    pr_axes.set(xlabel="Recall", ylabel="Precision", title=pr_title)
    if len(sample.classes) <= 20:  # beyond that the legend hides the curves; the JSON has them
        roc_axes.legend(fontsize=7, loc="lower right")
        pr_axes.legend(fontsize=7, loc="lower left")
    with atomic_file(path) as tmp:
        figure.savefig(tmp, format="png")
    return path


def reliability_png(analysis: Analysis, path: Path) -> Path:
    """The reliability diagram: accuracy against confidence per bin; the diagonal is calibrated."""
    figure = figure_of(5, 5)
    axes = figure.add_subplot()
    filled = [b for b in analysis.bins if b["rows"]]
    axes.bar([(b["low"] + b["high"]) / 2 for b in filled], [b["accuracy"] for b in filled],
             width=1 / CALIBRATION_BINS, edgecolor="black", label="accuracy")  # fmt: skip
    axes.plot([0, 1], [0, 1], color="grey", linestyle=":", label="calibrated")
    axes.set(xlim=(0, 1), ylim=(0, 1), xlabel="Confidence (highest probability)",
             ylabel="Accuracy", title=f"Reliability (ECE {analysis.ece:.3f})")  # fmt: skip
    axes.legend(loc="upper left")
    with atomic_file(path) as tmp:
        figure.savefig(tmp, format="png")
    return path


def gallery_png(wrong: list[WrongImage], images: Path, path: Path) -> Path:
    """The most confidently wrong images, each titled true -> predicted (confidence). An image
    that cannot be read any more is a blank tile with its reason."""
    from tasks.data.imagedir import load_rgb

    columns = 4
    rows = max(1, -(-len(wrong) // columns))
    figure = figure_of(2.4 * columns, 2.6 * rows)
    axes = np.atleast_1d(figure.subplots(rows, columns)).ravel()
    for tile, item in zip(axes, wrong, strict=False):
        try:
            image = load_rgb(images / item.path)
            image.thumbnail((256, 256))
            tile.imshow(np.asarray(image))
        except Exception as exc:  # a gallery tile must not sink the evaluation
            tile.text(0.5, 0.5, type(exc).__name__, ha="center", va="center")
        title_tile(tile, item)
    return save_grid(figure, axes, "Most confidently wrong (true -> predicted)", path)


def title_tile(tile: Any, item: WrongImage) -> None:
    """A wrong image's tile title: true -> predicted (the wrong answer's confidence)."""
    names = f"{visible_name(item.truth)} -> {visible_name(item.predicted)}"
    tile.set_title(f"{names} ({item.confidence:.2f})", fontsize=8, parse_math=False)


def save_grid(figure: Figure, axes: Any, title: str, path: Path) -> Path:
    """A grid of image tiles, without axes, titled, written atomically to ``path``."""
    for tile in axes:
        tile.set_axis_off()
    figure.suptitle(title)
    with atomic_file(path) as tmp:
        figure.savefig(tmp, format="png")
    return path
