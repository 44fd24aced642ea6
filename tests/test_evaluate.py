"""Evaluate Model: metrics checked against scikit-learn, files beside the table, MLflow logging."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from PIL import Image
from projects import imageops
from sklearn.metrics import (
    accuracy_score,
    confusion_matrix,
    f1_score,
    precision_recall_fscore_support,
    precision_score,
    recall_score,
    top_k_accuracy_score,
)

from tasks.inference.evaluate import compute_metrics, evaluate, table_metrics
from tasks.inference.score import score
from tasks.shared.errors import InvalidParameterError, NotLabeledDatasetError
from tasks.shared.settings import Settings
from tasks.shared.tracking import configure_mlflow

pytest_plugins = ["model_fixtures"]

CLASSES = ["0", "1", "2"]
PROBS = [f"Scored Probabilities_{c}" for c in CLASSES]


@pytest.fixture(scope="module")
def scored_val(
    exported_model: Path, digits_split: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The validation digits scored by the session model (CSV). Do not modify."""
    return score(exported_model, digits_split[1], tmp_path_factory.mktemp("scored") / "val.csv")


def test_metrics_match_scikit_learn_and_go_to_the_given_run(
    project: Settings, scored_val: Path, tmp_path: Path
) -> None:
    scored = tmp_path / scored_val.name
    scored.write_bytes(scored_val.read_bytes())  # the outputs land beside the table
    experiment_id = configure_mlflow(project)
    client = MlflowClient()
    run_id = client.create_run(experiment_id, run_name="train").info.run_id

    result = evaluate(scored, settings=project, run_id=run_id)

    table = pd.read_csv(scored, dtype={"category": str, "Scored Labels": str})
    truth, predicted = table["category"], table["Scored Labels"]
    assert result["accuracy"] == pytest.approx(accuracy_score(truth, predicted))
    # k = min(5, 3 classes): every truth is in the top 3 (scikit-learn refuses to call that a
    # metric; the ten-class test below compares top-k with it).
    assert result.top_k == 3
    assert result["top5_accuracy"] == 1.0
    for name, fn in (("precision", precision_score), ("recall", recall_score), ("f1", f1_score)):
        expected = fn(truth, predicted, labels=CLASSES, average="macro", zero_division=0)
        assert result[f"{name}_macro"] == pytest.approx(expected)
    expected_cm = confusion_matrix(truth, predicted, labels=CLASSES)
    confusion = json.loads(result.paths["confusion_json"].read_text())
    assert confusion == {"labels": CLASSES, "matrix": expected_cm.tolist()}
    per_class = pd.read_csv(result.paths["per_class_csv"], dtype={"class": str})
    assert per_class["class"].tolist() == CLASSES
    assert per_class["support"].tolist() == [int((truth == c).sum()) for c in CLASSES]

    png = result.paths["confusion_png"]
    assert png.parent == scored.parent
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in scored.parent.iterdir() if p.name.startswith(".")]  # no temp files

    assert result.run_id == run_id
    assert [r.info.run_id for r in client.search_runs([experiment_id])] == [run_id]
    assert client.get_run(run_id).info.status == "RUNNING"  # still training: its owner ends it
    logged = {a.path for a in client.list_artifacts(run_id, "evaluation")}
    assert "evaluation/val.confusion.png" in logged
    assert "evaluation/val.per_class.csv" in logged
    metrics = client.get_run(run_id).data.metrics
    assert metrics["eval_accuracy"] == pytest.approx(result["accuracy"])
    assert metrics["eval_f1_macro"] == pytest.approx(result["f1_macro"])


def test_without_a_run_id_a_new_run_is_made(project: Settings, scored_val: Path, tmp_path: Path):
    scored = tmp_path / "copy.csv"
    scored.write_bytes(scored_val.read_bytes())
    result = evaluate(scored, settings=project)
    run = MlflowClient().get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["eval_top5_accuracy"] == pytest.approx(result["top5_accuracy"])
    assert run.data.tags["eval_top_k"] == "3"


def test_the_command_logs_to_mlflow_only_when_asked(
    project: Settings, scored_val: Path, tmp_path: Path
) -> None:
    scored = tmp_path / "copy.csv"
    scored.write_bytes(scored_val.read_bytes())
    experiment_id = configure_mlflow(project)
    client = MlflowClient()

    files_only = imageops("evaluate", str(scored), cwd=tmp_path)
    assert files_only.returncode == 0, files_only.stderr
    assert "accuracy:" in files_only.stdout
    assert json.loads((tmp_path / "copy.metrics.json").read_text())["top_k"] == 3
    assert client.search_runs([experiment_id]) == []

    logged = imageops("evaluate", str(scored), "--new-run", cwd=tmp_path)
    assert logged.returncode == 0, logged.stderr
    (run,) = client.search_runs([experiment_id])
    assert run.info.run_name == "evaluate-copy" and "eval_accuracy" in run.data.metrics

    both = imageops("evaluate", str(scored), "--new-run", "--run-id", run.info.run_id, cwd=tmp_path)
    assert both.returncode != 0
    assert "--run-id and --new-run were both given" in both.stderr
    assert len(client.search_runs([experiment_id])) == 1


def test_top_k_and_per_class_on_a_ten_class_table_match_scikit_learn() -> None:
    # More classes than k, so top-5 is not trivially 1: seeded scores, biased to the truth.
    rng = np.random.default_rng(0)
    classes = [f"c{i}" for i in range(10)]
    truth = rng.integers(0, 10, size=200)
    logits = rng.normal(size=(200, 10))
    logits[np.arange(200), truth] += 1.0
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    table = pd.DataFrame({"id": range(200), "path": [f"{i}.png" for i in range(200)]})
    table["category"] = np.array(classes)[truth]
    for i, c in enumerate(classes):
        table[f"Scored Probabilities_{c}"] = probs[:, i]
    table["Scored Labels"] = np.array(classes)[probs.argmax(axis=1)]

    result = compute_metrics(table)

    assert result.top_k == 5
    expected_top5 = top_k_accuracy_score(table["category"], probs, k=5, labels=classes)
    assert 0.5 < expected_top5 < 1.0
    assert result["top5_accuracy"] == pytest.approx(expected_top5)
    p, r, f, s = precision_recall_fscore_support(
        table["category"], table["Scored Labels"], labels=classes, zero_division=0
    )
    assert [row["class"] for row in result.per_class] == classes
    np.testing.assert_allclose([row["precision"] for row in result.per_class], p)
    np.testing.assert_allclose([row["recall"] for row in result.per_class], r)
    np.testing.assert_allclose([row["f1"] for row in result.per_class], f)
    assert [row["support"] for row in result.per_class] == s.tolist()
    # Imbalanced classes (seeded draws), so weighted and macro averages differ.
    for i, name in enumerate(("precision", "recall", "f1")):
        weighted = precision_recall_fscore_support(
            table["category"], table["Scored Labels"], labels=classes, average="weighted",
            zero_division=0,
        )[i]  # fmt: skip
        assert result[f"{name}_weighted"] == pytest.approx(weighted)
    assert result["f1_weighted"] != pytest.approx(result["f1_macro"])


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_a_table_read_a_chunk_at_a_time_gives_the_whole_tables_metrics(
    tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """evaluate and promote read a scored table in chunks (memory flat in its rows): the chunks'
    tally must be the whole table's, unread images and a class the model never knew included."""
    rng = np.random.default_rng(1)
    classes = ["0", "1", "2", "10"]  # names that pandas would turn into numbers
    truth = np.array([*classes, "unknown"])[rng.integers(0, 5, size=53)]
    probs = rng.dirichlet(np.ones(4), size=53)
    table = pd.DataFrame({"id": range(53), "path": [f"{t}/{i}.png" for i, t in enumerate(truth)]})
    table["category"] = truth
    table["Scoring Error"] = ["OSError: truncated" if i % 11 == 0 else "" for i in range(53)]
    for i, c in enumerate(classes):
        table[f"Scored Probabilities_{c}"] = np.where(
            table["Scoring Error"] == "", probs[:, i], np.nan
        )
    table["Scored Labels"] = np.where(
        table["Scoring Error"] == "", np.array(classes)[probs.argmax(axis=1)], ""
    )
    path = tmp_path / f"scores{suffix}"
    if suffix == ".csv":
        table.to_csv(path, index=False)
    else:
        table.to_parquet(path, index=False)
    whole = compute_metrics(table)
    assert whole["unscored_images"] == 5 and "unknown" in whole.labels

    monkeypatch.setattr("tasks.inference.evaluate.EVALUATED_ROWS", 7)  # 8 chunks
    chunked = table_metrics(path)

    assert chunked.metrics == pytest.approx(whole.metrics)
    assert (chunked.labels, chunked.confusion, chunked.per_class) == (
        whole.labels,
        whole.confusion,
        whole.per_class,
    )
    header_only = tmp_path / f"empty{suffix}"
    if suffix == ".csv":
        table.iloc[:0].to_csv(header_only, index=False)
    else:
        table.iloc[:0].to_parquet(header_only, index=False)
    with pytest.raises(InvalidParameterError, match="not a non-empty Score Image Model table"):
        table_metrics(header_only)


def _other_model(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` as another model scored it: right on every image but every third one."""
    other = table.copy()
    other["Scored Labels"] = other["category"]
    rows = other.index[::3]
    wrong = other.loc[rows, "category"].map(lambda c: CLASSES[(CLASSES.index(c) + 1) % 3])
    other.loc[rows, "Scored Labels"] = wrong
    return other


def test_two_tables_are_evaluated_side_by_side(
    project: Settings, scored_val: Path, tmp_path: Path
) -> None:
    champion = tmp_path / "champion.csv"
    champion.write_bytes(scored_val.read_bytes())
    table = pd.read_csv(champion, dtype={"category": str, "Scored Labels": str})
    challenger = tmp_path / "other" / "challenger.csv"
    challenger.parent.mkdir()
    _other_model(table).to_csv(challenger, index=False)

    result = evaluate(champion, compare=challenger, settings=project)

    assert result.compared is not None
    wrong = len(table.index[::3])
    assert result.compared["accuracy"] == pytest.approx(1 - wrong / len(table))
    assert result["accuracy"] == pytest.approx(
        accuracy_score(table["category"], table["Scored Labels"])
    )
    # Each table's files land beside it.
    assert result.compared.paths["confusion_png"] == challenger.with_suffix(".confusion.png")
    assert result.compared.paths["confusion_png"].is_file()
    metrics = MlflowClient().get_run(result.run_id).data.metrics
    assert metrics["eval_accuracy"] == pytest.approx(result["accuracy"])
    assert metrics["eval_compare_accuracy"] == pytest.approx(result.compared["accuracy"])
    assert metrics["eval_compare_f1_weighted"] == pytest.approx(result.compared["f1_weighted"])
    logged = {a.path for a in MlflowClient().list_artifacts(result.run_id, "evaluation/compare")}
    assert "evaluation/compare/challenger.confusion.png" in logged


def test_comparing_a_table_with_itself_is_refused(project: Settings, scored_val: Path) -> None:
    with pytest.raises(InvalidParameterError, match="compare is the scored table itself"):
        evaluate(scored_val, compare=scored_val, settings=project)


def test_unlabeled_table_is_refused(
    project: Settings, exported_model: Path, digits_raw: Path, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    folder = work / "unlabeled"
    folder.mkdir(parents=True)
    for path in sorted(digits_raw.rglob("*.png"))[:4]:
        (folder / path.name).write_bytes(path.read_bytes())
    scored = score(exported_model, folder, work / "unlabeled.parquet")

    with pytest.raises(NotLabeledDatasetError, match="no `category` column"):
        evaluate(scored, settings=project)
    assert sorted(p.name for p in work.iterdir()) == ["unlabeled", "unlabeled.parquet"]


@pytest.mark.slow
def test_inside_a_prefect_flow_the_results_become_prefect_artifacts(
    prefect_api: None, project: Settings, scored_val: Path, tmp_path: Path
) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from tasks.inference.evaluate import evaluate_task

    scored = tmp_path / "flow.csv"
    scored.write_bytes(scored_val.read_bytes())
    compare = tmp_path / "weaker.csv"
    _other_model(pd.read_csv(scored, dtype={"category": str, "Scored Labels": str})).to_csv(
        compare, index=False
    )

    @flow(name="evaluate-only")
    def evaluate_flow(path: Path, other: Path) -> tuple[float, float]:
        result = evaluate_task(path, compare=other, settings=project)
        return result["accuracy"], result.compared["accuracy"]

    state = evaluate_flow(scored, compare, return_state=True)
    accuracy, weaker = state.result()

    with get_client(sync_client=True) as client:  # this run's artifacts
        this_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        artifacts = {a.key: a for a in client.read_artifacts(flow_run_filter=this_run)}
    assert artifacts["evaluation-per-class"].type == "table"
    rows = json.loads(artifacts["evaluation-per-class"].data)
    assert [row["class"] for row in rows] == CLASSES
    # Rounded for people: 0.9474, not 0.9473684210526315.
    assert all(len(str(row["precision"]).partition(".")[2]) <= 4 for row in rows), rows
    compared = json.loads(artifacts["evaluation-compare-per-class"].data)
    assert [row["class"] for row in compared] == CLASSES
    summary = artifacts["evaluation-summary"]
    assert summary.type == "markdown"
    assert f"| accuracy | {accuracy:.4f} | {weaker:.4f} |" in summary.data
    for name in ("flow.csv", "weaker.csv"):
        assert f"![confusion matrix of {name}](data:image/png;base64," in summary.data


def test_rows_of_unreadable_images_are_counted_not_scored_wrong(
    project: Settings, scored_val: Path, tmp_path: Path
) -> None:
    table = pd.read_csv(
        scored_val, dtype={"category": str, "Scored Labels": str, "Scoring Error": str}
    )
    table.loc[0, "Scoring Error"] = "UnidentifiedImageError: cannot identify image file"
    table.loc[0, PROBS] = np.nan
    table.loc[0, "Scored Labels"] = ""
    scored = tmp_path / "with_error.csv"
    table.to_csv(scored, index=False)

    result = evaluate(scored, settings=project)

    rest = table.iloc[1:]
    assert result["unscored_images"] == 1
    assert result["images"] == len(rest)
    assert result["accuracy"] == pytest.approx(
        accuracy_score(rest["category"], rest["Scored Labels"])
    )


def strict_json_file(path: Path) -> object:
    """``path`` parsed as strict JSON: NaN, Infinity and -Infinity are refused."""

    def refuse(constant: str) -> object:
        raise ValueError(f"{path.name} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def _printed(key: str, stdout: str) -> str:
    """The value the CLI printed for ``key`` (``key: value`` lines)."""
    return next(line for line in stdout.splitlines() if line.startswith(f"{key}: "))[len(key) + 2 :]


def test_imageops_evaluate_draws_the_curves_calibration_gallery_and_gradcam(
    scored_val: Path, exported_model: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    table = pd.read_csv(scored_val, dtype={"category": str, "Scored Labels": str},
                        keep_default_na=False)  # fmt: skip
    for row in table.index[table["category"] == table["Scored Labels"]][:2]:
        truth = table.loc[row, "category"]  # relabelled: the model gets it wrong for sure
        table.loc[row, "category"] = next(c for c in CLASSES if c != truth)
    scored = tmp_path / "val.csv"
    table.to_csv(scored, index=False)
    result = imageops(
        "evaluate", str(scored), "--images", str(digits_split[1]), "--model",
        str(exported_model), cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "roc_auc_macro:" in result.stdout and "ece:" in result.stdout
    # Every file is JSON a strict parser takes (JavaScript's refuses NaN); counts are integers.
    written = {kind: strict_json_file(tmp_path / f"val.{kind}.json")
               for kind in ("metrics", "per_class", "calib", "confusion")}  # fmt: skip
    metrics = written["metrics"]
    assert 0.5 < metrics["roc_auc_macro"] <= 1 and 0 <= metrics["ece"] <= 1
    assert type(metrics["images"]) is int and type(metrics["unscored_images"]) is int
    assert _printed("images", result.stdout) == str(metrics["images"])  # not 4250.0000
    assert len(_printed("accuracy", result.stdout)) == len("0.9701")  # rounded for people
    per_class = written["per_class"]
    assert all(0 <= row["roc_auc"] <= 1 and 0 <= row["pr_auc"] <= 1 for row in per_class)
    bins = written["calib"]
    assert sum(b["rows"] for b in bins) == metrics["images"]
    empty = [b for b in bins if b["rows"] == 0]
    assert empty and all(b["accuracy"] is None and b["confidence"] is None for b in empty)
    pictures = ("roc_pr", "calib", "confusion", "wrong", "gradcam")
    for name in (f"val.{kind}.png" for kind in pictures):
        with Image.open(tmp_path / name) as picture:
            assert picture.width > 300, name

    elsewhere = tmp_path / "plain"  # without the images: everything but the gallery
    elsewhere.mkdir()
    result = evaluate(shutil.copy(scored, elsewhere / "val.csv"), log_to_mlflow=False)
    assert {"curves_png", "reliability_png"} <= set(result.paths)
    assert "wrong_png" not in result.paths and not (elsewhere / "val.wrong.png").exists()
    assert "gradcam_png" not in result.paths
