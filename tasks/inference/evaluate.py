"""Evaluate Model: metrics of a scored table, written beside it and logged to MLflow when asked.

Accuracy, top-k accuracy (k = min(5, classes)) from the probability columns, per-class
precision/recall/F1 with macro and weighted averages (as scikit-learn defines them), and the
confusion matrix as a PNG and as JSON. Like the Azure component, a second scored table (its second
input, e.g. the same images scored by another model) is evaluated side by side. Metrics go to MLflow
with the ``eval_`` prefix (``eval_compare_`` for the second table), in the given run (resumed, never
a second one) or a new run, unless the caller asks for the files alone (``imageops evaluate``
without ``--run-id`` or ``--new-run``: MLflow's import and store cost over a second, more than the
evaluation); inside a Prefect run they are also published as Prefect artifacts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from models.atomic import atomic_file, check_name_length, write_json
from tasks.inference.error_analysis import (
    Analysis,
    ScoreSample,
    analyse,
    confusion_png,
    curves_png,
    gallery_png,
    reliability_png,
)
from tasks.inference.score import ERROR_COLUMN, LABEL_COLUMN, PROBABILITY_PREFIX
from tasks.inference.score.table import TRUE_LABEL_COLUMN
from tasks.inference.tables import CSV_FORMAT, table_format
from tasks.shared.artifacts import png_markdown, publish_markdown, publish_table
from tasks.shared.errors import InvalidParameterError, NotLabeledDatasetError
from tasks.shared.settings import Settings, get_settings
from tasks.shared.step import in_prefect_run, step, step_logger, tasks_on_first_use

ARTIFACT_DIR = "evaluation"
# Rows of the summary table: metric key -> label (top-k's label names its k).
SUMMARY_ROWS = {
    "accuracy": "accuracy",
    "top5_accuracy": "top-{k} accuracy",
    "precision_macro": "macro precision",
    "recall_macro": "macro recall",
    "f1_macro": "macro F1",
    "precision_weighted": "weighted precision",
    "recall_weighted": "weighted recall",
    "f1_weighted": "weighted F1",
    "roc_auc_macro": "macro ROC AUC (one vs rest)",
    "pr_auc_macro": "macro PR AUC (average precision)",
    "ece": "expected calibration error",
}
TOP_K = 5
EVALUATED_ROWS = 50_000  # rows of a scored table read at a time (table_metrics)


@dataclass(frozen=True)
class EvaluationResult(Mapping[str, float]):
    """The metrics by name (``result["accuracy"]``; the image counts are ints), plus the files
    written and the MLflow run."""

    metrics: dict[str, float]
    per_class: list[dict[str, float | int | str]]
    labels: list[str]
    confusion: list[list[int]]
    top_k: int
    paths: dict[str, Path] = field(default_factory=dict)
    run_id: str | None = None
    compared: EvaluationResult | None = None  # the second table's, when one was given
    # ROC/PR areas, calibration, the most confidently wrong rows; and what the curves are drawn
    # from (tasks.inference.error_analysis)
    analysis: Analysis | None = field(default=None, repr=False, compare=False)
    sample: ScoreSample | None = field(default=None, repr=False, compare=False)

    def __getitem__(self, key: str) -> float:
        return self.metrics[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.metrics)

    def __len__(self) -> int:
        return len(self.metrics)


def table_metrics(path: Path) -> EvaluationResult:
    """:func:`compute_metrics` of the scored table at ``path``, read ``EVALUATED_ROWS`` at a time.

    Memory follows the chunk, not the table: a whole read of 200,000 rows cost 90 MB more than of
    10,000 (docs/benchmarks.md, "Data at scale"); what stays is the probabilities as float32 (for
    the ROC and PR curves) and a few wrong rows' paths (for the gallery).
    """
    path = Path(path)
    if not path.is_file():
        raise InvalidParameterError(f"Scored table {path} does not exist.", "Run the score step.")
    tally = _Tally()
    chunks = table_format(path, "scored table").read_chunks(
        path,
        ["path", TRUE_LABEL_COLUMN, LABEL_COLUMN, ERROR_COLUMN],
        EVALUATED_ROWS,
        leave_out=["id"],
    )
    for chunk in chunks:
        tally.add(chunk)
    return tally.result()


def compute_metrics(table: pd.DataFrame) -> EvaluationResult:
    """All metrics of a labeled scored table (no files, no MLflow): the pure core of evaluate."""
    tally = _Tally()
    tally.add(table)
    return tally.result()


class _Tally:
    """What the metrics need from a scored table, added up a chunk of rows at a time: the count
    of each (true class, predicted class) pair, the top-k hits and the rows that were not scored."""

    def __init__(self) -> None:
        self.classes: list[str] = []
        self.prob_columns: list[str] = []
        self.pairs: Counter[tuple[str, str]] = Counter()
        self.scored = self.unscored = self.top_k_hits = 0
        self.sample = ScoreSample([])

    def _check(self, table: pd.DataFrame) -> None:
        if TRUE_LABEL_COLUMN not in table.columns:
            raise NotLabeledDatasetError(
                "The scored table has no `category` column: it was scored from unlabeled images, "
                "so there is no truth to evaluate against.",
                "Score a labeled ImageDirectory (one sub-folder per class) and evaluate that "
                "table.",
            )
        self.prob_columns = [c for c in table.columns if c.startswith(PROBABILITY_PREFIX)]
        if not self.prob_columns or LABEL_COLUMN not in table.columns:
            raise _not_a_scored_table()
        self.classes = [c.removeprefix(PROBABILITY_PREFIX) for c in self.prob_columns]
        self.sample = ScoreSample(self.classes)

    def add(self, table: pd.DataFrame) -> None:
        if not self.classes:
            self._check(table)
        # Rows without scores are counted apart, not as wrong answers: those with a reason, and
        # those whose scores are not numbers (tables written before NaN scores became error
        # rows have empty probabilities, the label of class 0 and no reason).
        probs = table[self.prob_columns].apply(pd.to_numeric, errors="coerce").to_numpy(np.float64)
        failed = ~np.isfinite(probs).all(axis=1)
        if ERROR_COLUMN in table.columns:
            failed |= (table[ERROR_COLUMN].fillna("").astype(str) != "").to_numpy()
        self.unscored += int(failed.sum())
        table, probs = table[~failed], probs[~failed]
        truth = table[TRUE_LABEL_COLUMN].astype(str).to_numpy()
        predicted = table[LABEL_COLUMN].astype(str).to_numpy()
        top = np.argsort(-probs, axis=1, kind="stable")[:, : self.top_k]
        index = {c: i for i, c in enumerate(self.classes)}
        true_index = np.array([index.get(t, -1) for t in truth], dtype=np.int64)
        self.top_k_hits += int((top == true_index[:, None]).any(axis=1).sum())
        self.pairs.update(zip(truth.tolist(), predicted.tolist(), strict=True))
        paths = table["path"].astype(str).tolist() if "path" in table.columns else [""] * len(table)
        self.sample.add(probs, truth, paths, predicted)
        self.scored += len(table)

    @property
    def top_k(self) -> int:
        return min(TOP_K, len(self.classes))

    def result(self) -> EvaluationResult:
        if not self.scored:
            if not self.unscored:
                raise _not_a_scored_table()
            raise InvalidParameterError(
                f"None of the {self.unscored} image(s) of the table was scored (see its "
                f"`{ERROR_COLUMN}` column).",
                "Fix or remove the images it names (a model that returned NaN or infinite "
                "scores: train or export it again) and score again.",
            )
        # A true class the model never learned still counts: as a row of the report, always wrong.
        labels = self.classes + sorted({t for t, _ in self.pairs} - set(self.classes))
        matrix, support = _confusion(self.pairs, labels)
        precision, recall, f1 = _per_class(matrix, support)
        scores = (precision, recall, f1)
        analysis = analyse(self.sample)
        areas = {c: (analysis.roc_auc[i], analysis.pr_auc[i]) for i, c in enumerate(self.classes)}
        macro = [float(values.mean()) for values in scores]
        weighted = [float(np.average(values, weights=support)) for values in scores]
        metrics = {
            "accuracy": float(np.trace(matrix) / self.scored),
            "top5_accuracy": self.top_k_hits / self.scored,
            "precision_macro": macro[0],
            "recall_macro": macro[1],
            "f1_macro": macro[2],
            "precision_weighted": weighted[0],
            "recall_weighted": weighted[1],
            "f1_weighted": weighted[2],
            "roc_auc_macro": analysis.macro(analysis.roc_auc),
            "pr_auc_macro": analysis.macro(analysis.pr_auc),
            "ece": analysis.ece,
            "images": self.scored,  # counts stay integers in the JSON, MLflow and the CLI
            "unscored_images": self.unscored,
        }
        per_class = [
            {
                "class": label,
                "precision": float(precision[i]),
                "recall": float(recall[i]),
                "f1": float(f1[i]),
                "support": int(support[i]),
                # one vs rest; none for a true class the model has no score for
                "roc_auc": _finite(areas.get(label, (None, None))[0]),
                "pr_auc": _finite(areas.get(label, (None, None))[1]),
            }
            for i, label in enumerate(labels)
        ]
        return EvaluationResult(
            metrics=metrics,
            per_class=per_class,
            labels=labels,
            confusion=matrix.tolist(),
            top_k=self.top_k,
            analysis=analysis,
            sample=self.sample,
        )


def _finite(value: float | None) -> float | None:
    """A number for the JSON and CSV files; None (empty) for an area that does not exist."""
    return None if value is None or not np.isfinite(value) else float(value)


def _not_a_scored_table() -> InvalidParameterError:
    return InvalidParameterError(
        "The table is not a non-empty Score Image Model table (it needs "
        f"`{PROBABILITY_PREFIX}<class>` columns and `{LABEL_COLUMN}`).",
        "Pass the output of the score step.",
    )


def _confusion(
    pairs: Mapping[tuple[str, str], int], labels: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """The confusion matrix (rows: true) and each class's support, from the pairs' counts.

    A prediction outside ``labels`` is a miss for its true class and nobody's false positive, as
    in scikit-learn's ``confusion_matrix(labels=...)``.
    """
    where = {label: i for i, label in enumerate(labels)}
    matrix = np.zeros((len(labels), len(labels)), dtype=np.int64)
    support = np.zeros(len(labels), dtype=np.int64)
    for (true, guess), count in pairs.items():
        support[where[true]] += count  # labels holds every truth
        if guess in where:
            matrix[where[true], where[guess]] += count
    return matrix, support


def _per_class(
    matrix: np.ndarray, support: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-class precision, recall and F1 from the confusion matrix and the supports.

    What scikit-learn's ``precision_recall_fscore_support(labels=..., zero_division=0)`` returns
    (tests/test_evaluate.py holds them to it), in a few lines of numpy: importing scikit-learn
    (and scipy with it) cost more than a second of every `imageops evaluate`.
    """
    n = len(support)
    hits = np.diag(matrix).astype(np.float64)
    guessed = matrix.sum(axis=0)

    def ratio(top: np.ndarray, bottom: np.ndarray) -> np.ndarray:
        return np.divide(top, bottom, out=np.zeros(n), where=bottom > 0)

    # F1 as scikit-learn computes it: 2 tp / (2 tp + fp + fn), 0 where nothing was true or guessed.
    return ratio(hits, guessed), ratio(hits, support), ratio(2 * hits, guessed + support)


def _summary_markdown(result: EvaluationResult, scored: Path, compare: Path | None) -> str:
    """One table, one column per scored table: the Azure design's side-by-side view."""
    columns = [result] if result.compared is None else [result, result.compared]
    names = [scored.name] if compare is None else [scored.name, compare.name]
    title = " vs ".join(f"`{name}`" for name in names)
    lines = [
        f"# Evaluation of {title}",
        "",
        "| metric | " + " | ".join(f"`{name}`" for name in names) + " |",
        "| --- |" + " --- |" * len(names),
        "| images | " + " | ".join(str(int(r["images"])) for r in columns) + " |",
        "| images not scored (unreadable, NaN scores) | "
        + " | ".join(str(int(r["unscored_images"])) for r in columns)
        + " |",
    ]
    for key, label in SUMMARY_ROWS.items():
        values = " | ".join(f"{r[key]:.4f}" for r in columns)
        lines.append(f"| {label.format(k=result.top_k)} | {values} |")
    if result.run_id:
        lines += ["", f"MLflow run: `{result.run_id}`"]
    pictures = {
        "confusion_png": "confusion matrix",
        "curves_png": "ROC and precision-recall curves",
        "reliability_png": "reliability diagram",
        "wrong_png": "most confidently wrong images",
        "gradcam_png": "Grad-CAM of the most confidently wrong images",
    }
    for name, r in zip(names, columns, strict=True):
        for kind, what in pictures.items():
            if kind in r.paths:
                alt = what if len(names) == 1 else f"{what} of {name}"
                lines += ["", png_markdown(r.paths[kind], alt)]
    return "\n".join(lines) + "\n"


def _publish_prefect_artifacts(
    result: EvaluationResult, scored: Path, compare: Path | None
) -> None:
    tables = [("evaluation-per-class", result, scored)]
    if result.compared is not None and compare is not None:
        tables.append(("evaluation-compare-per-class", result.compared, compare))
    for key, r, path in tables:
        publish_table(key, r.per_class, f"Per-class precision, recall and F1 of {path.name}")
    title = scored.name if compare is None else f"{scored.name} vs {compare.name}"
    publish_markdown(
        "evaluation-summary", _summary_markdown(result, scored, compare), f"Evaluation of {title}"
    )


def output_paths(scored: Path) -> dict[str, Path]:
    """Where the result's files go, by kind: beside ``scored``, named after it.

    Raises InvalidParameterError when a name would be longer than the file system takes (a
    scored table with a name of 241 bytes or more), before anything is read or written.
    """
    stem = scored.parent / scored.stem
    paths = {
        "metrics": Path(f"{stem}.metrics.json"),
        "per_class_csv": Path(f"{stem}.per_class.csv"),
        "per_class_json": Path(f"{stem}.per_class.json"),
        "confusion_png": Path(f"{stem}.confusion.png"),
        "confusion_json": Path(f"{stem}.confusion.json"),
        "curves_png": Path(f"{stem}.roc_pr.png"),
        "reliability_png": Path(f"{stem}.calib.png"),
        "calibration_json": Path(f"{stem}.calib.json"),
        "wrong_png": Path(f"{stem}.wrong.png"),
        "gradcam_png": Path(f"{stem}.gradcam.png"),
    }
    try:
        for path in paths.values():
            check_name_length(path, "evaluation output")
    except InvalidParameterError as exc:
        raise InvalidParameterError(
            f"{exc.message} Evaluate names its outputs after the scored table {scored.name!r}.",
            "Rename the scored table to a shorter name (or score into one) and evaluate again.",
        ) from exc
    return paths


def _write_outputs(
    result: EvaluationResult, scored: Path, images: Path | None, model: Path | None
) -> dict[str, Path]:
    """The result's files beside ``scored``, each written atomically; returns them by kind. The
    gallery of confidently wrong images only with ``images``, the folder that was scored; their
    Grad-CAM also with ``model``, the ModelDirectory that scored them."""
    paths = output_paths(scored)
    wrong = result.analysis.wrong if result.analysis is not None else []
    if result.analysis is not None and result.sample is not None:
        curves_png(result.sample, result.analysis, paths["curves_png"])
        reliability_png(result.analysis, paths["reliability_png"])
        write_json(paths["calibration_json"], result.analysis.bins)
    else:
        for kind in ("curves_png", "reliability_png", "calibration_json"):
            del paths[kind]
    if images is not None and wrong:
        gallery_png(wrong, images, paths["wrong_png"])
    else:
        del paths["wrong_png"]
    if images is None or not wrong or model is None:
        del paths["gradcam_png"]
    else:
        from tasks.inference.gradcam import gradcam_png

        if gradcam_png(wrong, images, model, paths["gradcam_png"]) is None:
            del paths["gradcam_png"]
    write_json(paths["metrics"], {**result.metrics, "top_k": result.top_k})
    with atomic_file(paths["per_class_csv"]) as tmp:
        pd.DataFrame(result.per_class).to_csv(tmp, index=False, **CSV_FORMAT)
    write_json(paths["per_class_json"], result.per_class)
    confusion_png(result.labels, result.confusion, paths["confusion_png"])
    write_json(paths["confusion_json"], {"labels": result.labels, "matrix": result.confusion})
    return paths


def _log_to_mlflow(
    settings: Settings,
    run_id: str | None,
    result: EvaluationResult,
    scored: Path,
    compare: Path | None,
) -> str:
    """Log ``result`` (its files, and the second table's as ``compare/``) into run ``run_id``
    (or a new one); returns the run's id."""
    import mlflow

    from tasks.shared.tracking import logged_value, mlflow_run, summary_metric

    def logged(metrics: Mapping[str, float], *prefix: str) -> dict[str, float]:
        """``eval_accuracy``, ``eval_compare_accuracy``: after the training's curves in MLflow."""
        return {summary_metric(*prefix, k): logged_value(v) for k, v in metrics.items()}

    with mlflow_run(settings, run_id, run_name=f"evaluate-{scored.stem}") as used_run:
        mlflow.log_metrics(logged(result.metrics, "eval"))
        # A tag, not a param: params are write-once, and a run may be evaluated again.
        mlflow.set_tag(summary_metric("eval", "top_k"), str(result.top_k))
        for path in result.paths.values():
            mlflow.log_artifact(str(path), artifact_path=ARTIFACT_DIR)
        if (compared := result.compared) is not None and compare is not None:
            mlflow.log_metrics(logged(compared.metrics, "eval", "compare"))
            mlflow.set_tag(summary_metric("eval", "compare", "table"), compare.name)
            for path in compared.paths.values():
                mlflow.log_artifact(str(path), artifact_path=f"{ARTIFACT_DIR}/compare")
    return used_run


def evaluate(
    scored: Path,
    *,
    compare: Path | None = None,
    settings: Settings | None = None,
    run_id: str | None = None,
    log_to_mlflow: bool = True,
    images: Path | None = None,
    model: Path | None = None,
) -> EvaluationResult:
    """Evaluate the labeled scored table ``scored`` (and ``compare`` beside it); write and log.

    Metrics files are written atomically beside each table and, with ``log_to_mlflow``, logged
    as ``eval_<name>`` (``eval_compare_<name>``) into run ``run_id`` (resumed) or a new run; the
    second table's result is ``result.compared``. ``images``: the folder that was scored, for the
    gallery of the most confidently wrong images (without it, no gallery); ``model``: the
    ModelDirectory that scored ``scored``, for Grad-CAM on those images (``compare``'s are not
    explained: another model scored them). Raises
    NotLabeledDatasetError (no ``category`` column) and InvalidParameterError (same file twice, a
    name too long). Details: docs/internals.md#evaluation.
    """
    settings = settings or get_settings()
    scored = Path(scored)
    compare = None if compare is None else Path(compare)
    if compare is not None and compare.resolve() == scored.resolve():
        raise InvalidParameterError(
            f"compare is the scored table itself ({scored}).",
            "Pass a second scored table (e.g. the same images scored by another model), or "
            "leave compare out.",
        )
    if compare is not None and compare.parent == scored.parent and compare.stem == scored.stem:
        raise InvalidParameterError(
            f"{scored.name} and {compare.name} would write their results to the same files.",
            "Give the two tables different names (e.g. champion.csv and challenger.csv).",
        )
    for table in (scored, compare):
        if table is not None:
            output_paths(table)  # a name too long is refused before any work
    result = table_metrics(scored)
    compared = None if compare is None else table_metrics(compare)
    log = step_logger(__name__)

    if compared is not None:
        compared = replace(compared, paths=_write_outputs(compared, compare, images, None))
    paths = _write_outputs(result, scored, images, model)
    result = replace(result, paths=paths, compared=compared)
    if log_to_mlflow:
        used_run = _log_to_mlflow(settings, run_id, result, scored, compare)
        if compared is not None:
            compared = replace(compared, run_id=used_run)
        result = replace(result, run_id=used_run, compared=compared)
    if in_prefect_run():
        _publish_prefect_artifacts(result, scored, compare)
    for name, r in ((scored, result), (compare, compared)):
        if r is not None:
            log.info(
                "Evaluated %s: accuracy %.4f, top-%d %.4f, macro F1 %.4f, weighted F1 %.4f",
                name,
                r["accuracy"],
                r.top_k,
                r["top5_accuracy"],
                r["f1_macro"],
                r["f1_weighted"],
            )
    return result


__getattr__ = tasks_on_first_use(
    globals(),
    evaluate_task=lambda: step(evaluate, name="evaluate"),
)
