"""The study's result: the trials table and the metric over trials, for Prefect and MLflow.

One row per trial: number, state, value, every tuned parameter (empty where a conditional child
was not tuned), duration, the MLflow run. Written as ``trials.csv`` and ``trials.json`` in the
study's folder and to the parent MLflow run's ``tuning/`` artifacts; published in Prefect as a
table artifact and a markdown report with the plot.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from mlflow import MlflowClient
from pydantic import BaseModel

from models.atomic import atomic_file, write_json, write_text
from tasks.inference.tables import CSV_FORMAT
from tasks.shared.artifacts import markdown_table, png_markdown, publish_markdown, publish_table
from tasks.shared.step import step_logger
from tasks.shared.tracking import summary_metric
from tasks.tune.storage import describe_storage
from tasks.tune.study import Study, TrialOutcome

TABLE_CSV = "trials.csv"
TABLE_JSON = "trials.json"
PLOT = "trials.png"
ARTIFACTS = "tuning"


class StudyResult(BaseModel):
    """A study as it stands after a tune flow: its trials, the best, and where to look."""

    study_name: str
    storage: str  # the journal file, or a note that it is the settings' database
    metric: str
    goal: str
    trials: list[TrialOutcome]
    best: TrialOutcome | None
    parent_run_id: str
    folder: Path
    registered_version: int | None = None


def trial_rows(trials: list[TrialOutcome], metric: str, names: list[str]) -> list[dict]:
    """The trials table: one plain row per trial (interrupted trials are marked so)."""
    rows = []
    for trial in trials:
        state = "INTERRUPTED" if trial.interrupted else trial.state
        row: dict[str, object] = {"number": trial.number, "state": state, metric: trial.value}
        row |= {name: trial.values.get(name) for name in names}
        row["duration_s"] = None if trial.duration_s is None else round(trial.duration_s, 1)
        row["mlflow_run_id"] = trial.run_id
        rows.append(row)
    return rows


def plot_trials(trials: list[TrialOutcome], metric: str, goal: str, path: Path) -> Path:
    """The metric of every trial by number, the best so far as a line; written atomically.

    A bare Figure on the Agg canvas (no pyplot state): safe in a flow's worker threads.
    """
    figure = Figure(figsize=(7, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    styles = {"COMPLETE": ("o", "tab:blue"), "PRUNED": ("x", "tab:grey")}
    for state, (marker, colour) in styles.items():
        points = [(t.number, t.value) for t in trials if t.state == state and t.value is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            label = "completed" if state == "COMPLETE" else "pruned (last epoch reported)"
            axes.scatter(xs, ys, marker=marker, color=colour, label=label, zorder=3)
    best, xs, ys = None, [], []
    for trial in sorted(trials, key=lambda t: t.number):
        if trial.state == "COMPLETE" and trial.value is not None:
            better = best is None or (
                trial.value > best if goal == "maximize" else trial.value < best
            )
            best = trial.value if better else best
        if best is not None:
            xs.append(trial.number)
            ys.append(best)
    if xs:
        axes.step(xs, ys, where="post", color="tab:orange", label="best so far")
    failed = [t.number for t in trials if t.state == "FAIL" and not t.interrupted]
    for number in failed:
        axes.axvline(number, color="tab:red", alpha=0.3, linestyle="--")
    if failed:
        axes.plot([], [], color="tab:red", alpha=0.3, linestyle="--", label="failed")
    axes.set_xlabel("trial")
    axes.set_ylabel(metric)
    axes.set_title(f"{metric} over trials ({goal})")
    axes.grid(alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(loc="best", fontsize=8)
    with atomic_file(path) as tmp:
        figure.savefig(tmp, format="png")
    return path


def trials_csv(rows: list[dict]) -> str:
    """The trials table as CSV text (empty cells for None), in the shared CSV format."""
    buffer = io.StringIO()
    if rows:
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), **CSV_FORMAT)
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    return buffer.getvalue()


def report_study(study: Study) -> StudyResult:
    """Write, log and publish the trials table and plot; return the study's result.

    Runs whatever happened (a failed study's table says why), so it never raises for a missing
    artifact store: a logging error is a warning, the study's own outcome comes first.
    """
    spec, job = study.spec, study.job
    trials = study.outcomes()
    best = study.best()
    names = [p.name for p in spec.parameters]
    rows = trial_rows(trials, spec.metric, names)
    folder = job.folder
    write_text(folder / TABLE_CSV, trials_csv(rows))
    write_json(folder / TABLE_JSON, [t.model_dump(mode="json") for t in trials])
    plot = plot_trials(trials, spec.metric, spec.goal, folder / PLOT)
    result = StudyResult(
        study_name=study.name,
        storage=describe_storage(job.storage),
        metric=spec.metric,
        goal=spec.goal,
        trials=trials,
        best=best,
        parent_run_id=job.parent_run_id,
        folder=folder,
    )
    _log_to_mlflow(study, result, [folder / TABLE_CSV, folder / TABLE_JSON, plot])
    summary = (
        f"best: trial {best.number}, {spec.metric} = {best.value:.4f} with {best.values} "
        f"(MLflow run `{best.run_id}`)"
        if best is not None and best.value is not None
        else "no trial completed"
    )
    counts = ", ".join(
        f"{sum(r['state'] == s for r in rows)} {s.lower()}"
        for s in ("COMPLETE", "PRUNED", "FAIL", "INTERRUPTED")
    )
    markdown = "\n\n".join(
        [
            f"### Study `{study.name}`: {spec.metric} ({spec.goal}), {spec.algorithm} search",
            f"{len(rows)} trials ({counts}); {summary}.",
            png_markdown(plot, "metric over trials"),
            # the run id's first 8 characters, so the table fits the panel (whole: tuning-trials)
            markdown_table([{**r, "mlflow_run_id": (r["mlflow_run_id"] or "")[:8]} for r in rows]),
        ]
    )
    publish_markdown("tuning-report", markdown, f"Trials of study {study.name}")
    publish_table("tuning-trials", rows, f"Trials of study {study.name} ({spec.metric})")
    return result


def _log_to_mlflow(study: Study, result: StudyResult, paths: list[Path]) -> None:
    client = MlflowClient(study.settings.tracking_uri, study.settings.registry_uri)
    run_id = study.job.parent_run_id
    try:
        for path in paths:
            client.log_artifact(run_id, str(path), artifact_path=ARTIFACTS)
        client.set_tag(run_id, "tune.trials", str(len(result.trials)))
        if result.best is not None and result.best.value is not None:
            client.log_metric(run_id, summary_metric("best", result.metric), result.best.value)
            client.set_tag(run_id, "tune.best_trial", str(result.best.number))
            client.set_tag(run_id, "tune.best_run_id", str(result.best.run_id))
    except Exception as exc:  # never hide the study's outcome behind its report
        step_logger(__name__).warning("could not log the study report to MLflow: %s", exc)
