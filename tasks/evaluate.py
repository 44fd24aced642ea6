"""Evaluate Model: metrics of a labeled scored table, written beside it and logged to MLflow.

Accuracy, top-k accuracy (k = min(5, classes)) from the probability columns, per-class
precision/recall/F1 with macro averages (scikit-learn), and the confusion matrix as a PNG and as
JSON. Metrics go to MLflow with the ``eval/`` prefix, in the given run (resumed, never a second
one) or a new run; inside a Prefect run they are also published as Prefect artifacts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from sklearn.metrics import confusion_matrix, precision_recall_fscore_support

from models.atomic import atomic_file, write_json
from tasks.artifacts import png_markdown, publish_markdown
from tasks.errors import InvalidParameterError, NotLabeledDatasetError
from tasks.score import LABEL_COLUMN, PROBABILITY_PREFIX
from tasks.settings import Settings, get_settings
from tasks.step import in_prefect_run, step, step_logger
from tasks.tracking import mlflow_run

METRIC_PREFIX = "eval/"
ARTIFACT_DIR = "evaluation"
TOP_K = 5


@dataclass(frozen=True)
class EvaluationResult(Mapping[str, float]):
    """The metrics by name (``result["accuracy"]``), plus the files written and the MLflow run."""

    metrics: dict[str, float]
    per_class: list[dict[str, float | int | str]]
    labels: list[str]
    confusion: list[list[int]]
    top_k: int
    paths: dict[str, Path] = field(default_factory=dict)
    run_id: str | None = None

    def __getitem__(self, key: str) -> float:
        return self.metrics[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.metrics)

    def __len__(self) -> int:
        return len(self.metrics)


def read_scored(path: Path) -> pd.DataFrame:
    """Read a scored table; class names stay strings (digit classes must not become ints)."""
    path = Path(path)
    if not path.is_file():
        raise InvalidParameterError(f"Scored table {path} does not exist.", "Run the score step.")
    if path.suffix.lower() == ".parquet":
        return pd.read_parquet(path)
    return pd.read_csv(
        path, dtype={"path": str, "category": str, LABEL_COLUMN: str}, keep_default_na=False
    )


def compute_metrics(table: pd.DataFrame) -> EvaluationResult:
    """All metrics of a labeled scored table (no files, no MLflow): the pure core of evaluate."""
    if "category" not in table.columns:
        raise NotLabeledDatasetError(
            "The scored table has no `category` column: it was scored from unlabeled images, so "
            "there is no truth to evaluate against.",
            "Score a labeled ImageDirectory (one sub-folder per class) and evaluate that table.",
        )
    prob_columns = [c for c in table.columns if c.startswith(PROBABILITY_PREFIX)]
    if not prob_columns or LABEL_COLUMN not in table.columns or table.empty:
        raise InvalidParameterError(
            "The table is not a non-empty Score Image Model table (it needs "
            f"`{PROBABILITY_PREFIX}<class>` columns and `{LABEL_COLUMN}`).",
            "Pass the output of the score step.",
        )
    classes = [c.removeprefix(PROBABILITY_PREFIX) for c in prob_columns]
    truth = table["category"].astype(str).to_numpy()
    predicted = table[LABEL_COLUMN].astype(str).to_numpy()
    # A true class the model never learned still counts: as a row of the report, always wrong.
    labels = classes + sorted(set(truth) - set(classes))

    k = min(TOP_K, len(classes))
    probs = table[prob_columns].to_numpy(dtype=np.float64)
    top = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    index = {c: i for i, c in enumerate(classes)}
    true_index = np.array([index.get(t, -1) for t in truth])
    top_k_hits = (top == true_index[:, None]).any(axis=1)

    precision, recall, f1, support = precision_recall_fscore_support(
        truth, predicted, labels=labels, zero_division=0
    )
    macro = precision_recall_fscore_support(
        truth, predicted, labels=labels, average="macro", zero_division=0
    )
    metrics = {
        "accuracy": float(np.mean(truth == predicted)),
        "top5_accuracy": float(top_k_hits.mean()),
        "precision_macro": float(macro[0]),
        "recall_macro": float(macro[1]),
        "f1_macro": float(macro[2]),
        "images": float(len(table)),
    }
    per_class = [
        {
            "class": label,
            "precision": float(precision[i]),
            "recall": float(recall[i]),
            "f1": float(f1[i]),
            "support": int(support[i]),
        }
        for i, label in enumerate(labels)
    ]
    matrix = confusion_matrix(truth, predicted, labels=labels)
    return EvaluationResult(
        metrics=metrics,
        per_class=per_class,
        labels=labels,
        confusion=matrix.tolist(),
        top_k=k,
    )


def confusion_png(labels: list[str], matrix: list[list[int]], path: Path) -> Path:
    """Draw the confusion matrix (rows: true class, columns: predicted) to a PNG, atomically.

    A bare Figure on the Agg canvas, not pyplot: no global figure state and no display needed,
    so it is safe in worker threads and on headless machines.
    """
    data = np.asarray(matrix)
    side = max(4.0, 0.5 * len(labels) + 2.0)
    figure = Figure(figsize=(side, side), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    image = axes.imshow(data, cmap="Blues")
    figure.colorbar(image, ax=axes, fraction=0.046)
    axes.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    axes.set_yticks(range(len(labels)), labels)
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


def _summary_markdown(result: EvaluationResult, scored: Path) -> str:
    m = result.metrics
    lines = [
        f"# Evaluation of `{scored.name}`",
        "",
        "| metric | value |",
        "| --- | --- |",
        f"| images | {int(m['images'])} |",
        f"| accuracy | {m['accuracy']:.4f} |",
        f"| top-{result.top_k} accuracy | {m['top5_accuracy']:.4f} |",
        f"| macro precision | {m['precision_macro']:.4f} |",
        f"| macro recall | {m['recall_macro']:.4f} |",
        f"| macro F1 | {m['f1_macro']:.4f} |",
    ]
    if result.run_id:
        lines += ["", f"MLflow run: `{result.run_id}`"]
    if "confusion_png" in result.paths:
        lines += ["", png_markdown(result.paths["confusion_png"], "confusion matrix")]
    return "\n".join(lines) + "\n"


def _publish_prefect_artifacts(result: EvaluationResult, scored: Path) -> None:
    from prefect.artifacts import create_table_artifact

    create_table_artifact(
        table=result.per_class,
        key="evaluation-per-class",
        description=f"Per-class precision, recall and F1 of {scored.name}",
    )
    publish_markdown(
        "evaluation-summary", _summary_markdown(result, scored), f"Evaluation of {scored.name}"
    )


def evaluate(
    scored: Path, *, settings: Settings | None = None, run_id: str | None = None
) -> EvaluationResult:
    """Evaluate the labeled scored table ``scored``; write and log the results.

    Files beside the table (``<stem>.metrics.json``, ``<stem>.per_class.csv``,
    ``<stem>.per_class.json``, ``<stem>.confusion.png``, ``<stem>.confusion.json``) are written
    atomically; metrics are logged as ``eval/<name>`` into MLflow run ``run_id`` (resumed) or a
    new run. Raises NotLabeledDatasetError when the table has no ``category`` column.
    """
    settings = settings or get_settings()
    scored = Path(scored)
    result = compute_metrics(read_scored(scored))
    log = step_logger(__name__)

    stem = scored.parent / scored.stem
    paths = {
        "metrics": Path(f"{stem}.metrics.json"),
        "per_class_csv": Path(f"{stem}.per_class.csv"),
        "per_class_json": Path(f"{stem}.per_class.json"),
        "confusion_png": Path(f"{stem}.confusion.png"),
        "confusion_json": Path(f"{stem}.confusion.json"),
    }
    write_json(paths["metrics"], {**result.metrics, "top_k": result.top_k})
    with atomic_file(paths["per_class_csv"]) as tmp:
        pd.DataFrame(result.per_class).to_csv(tmp, index=False)
    write_json(paths["per_class_json"], result.per_class)
    confusion_png(result.labels, result.confusion, paths["confusion_png"])
    write_json(paths["confusion_json"], {"labels": result.labels, "matrix": result.confusion})

    with mlflow_run(settings, run_id, run_name=f"evaluate-{scored.stem}") as used_run:
        mlflow.log_metrics({f"{METRIC_PREFIX}{k}": v for k, v in result.metrics.items()})
        # A tag, not a param: params are write-once, and a run may be evaluated again.
        mlflow.set_tag(f"{METRIC_PREFIX}top_k", str(result.top_k))
        for path in paths.values():
            mlflow.log_artifact(str(path), artifact_path=ARTIFACT_DIR)

    result = replace(result, paths=paths, run_id=used_run)
    if in_prefect_run():
        _publish_prefect_artifacts(result, scored)
    log.info(
        "Evaluated %s: accuracy %.4f, top-%d %.4f, macro F1 %.4f",
        scored,
        result["accuracy"],
        result.top_k,
        result["top5_accuracy"],
        result["f1_macro"],
    )
    return result


evaluate_task = step(evaluate, name="evaluate")
