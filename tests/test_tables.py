"""Every table imageops writes reads back identically with pandas and the csv module.

The tables are written by the real steps from the hostile corpus's odd names
(``hostile_inputs.ODD_NAMES``: line ends, tabs, quotes, commas, ``NA``, ``$``, escapes, spaces at
the ends, a 250-byte name and one that is not UTF-8): as file names in ``path``, as class names in
the column headers, in ``category``, ``Scored Labels`` and the per-class report, and as values of
the trials table. Each CSV file is read with ``pandas.read_csv`` (every cell as text, no
missing-value guessing) and with the csv module; both must give the same cells, and the cells must
be the names that went in. The Parquet table must hold the same names.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest
from hostile_inputs import LATIN1, LONG, ODD_NAMES, odd_folder, odd_model

from tasks.data.convert import convert
from tasks.data.split import split
from tasks.inference.evaluate import compute_metrics, evaluate, table_metrics
from tasks.inference.score import LABEL_COLUMN, PROBABILITY_PREFIX, score, score_in_shards
from tasks.inference.tables import TABLE_FORMATS, TableFormat, TableWriter, table_format
from tasks.shared.errors import InvalidParameterError
from tasks.shared.settings import Settings
from tasks.tune.report import trial_rows, trials_csv
from tasks.tune.study import TrialOutcome

pytest_plugins = ["model_fixtures"]

# The classes the 3-class session model is given: a line end, mathtext that does not parse, an
# escape sequence. The data has all ten odd classes, so the report also lists classes it lacks.
MODEL_CLASSES = (ODD_NAMES[0], ODD_NAMES[6], ODD_NAMES[8])


def _read_both_ways(path: Path) -> list[list[str]]:
    """The cells of a CSV file, header first, once pandas and the csv module agreed on them."""
    with open(path, encoding="utf-8", newline="") as fh:
        rows = list(csv.reader(fh, strict=True))
    frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    assert [list(frame.columns), *frame.to_numpy().tolist()] == rows
    return rows


def _column(rows: list[list[str]], name: str) -> list[str]:
    index = rows[0].index(name)
    return [row[index] for row in rows[1:]]


def test_scored_and_evaluated_tables_of_odd_names_read_back_identically(
    exported_model: Path, digits_raw: Path, project: Settings, tmp_path: Path
) -> None:
    raw = odd_folder(tmp_path / "raw", digits_raw, ODD_NAMES)
    manifest = convert(raw, tmp_path / "images")
    assert manifest.classes == sorted(ODD_NAMES)
    per_class = [f"{name}.png" for name in ODD_NAMES] + [LONG]
    assert sorted(e.path for e in manifest.images) == sorted(
        f"{label}/{name}" for label in ODD_NAMES for name in per_class
    )
    assert {s.reason.split(":")[0] for s in manifest.skipped} == {"BadFileName"}  # not UTF-8
    train, val = split(tmp_path / "images", tmp_path / "train", tmp_path / "val", fraction=0.5)
    assert sorted(e.path for e in train.images + val.images) == sorted(
        e.path for e in manifest.images
    )
    assert all((tmp_path / "val" / e.path).is_file() for e in val.images)
    model = odd_model(exported_model, tmp_path / "model", MODEL_CLASSES)

    scored = _read_both_ways(score(model, tmp_path / "val", tmp_path / "scored.csv"))
    columns = [f"{PROBABILITY_PREFIX}{name}" for name in MODEL_CLASSES]
    assert scored[0][-4:] == [*columns, LABEL_COLUMN]
    assert sorted(_column(scored, "path")) == sorted(e.path for e in val.images)
    assert set(_column(scored, "category")) == set(ODD_NAMES)
    assert set(_column(scored, LABEL_COLUMN)) <= set(MODEL_CLASSES)
    parquet = pd.read_parquet(score(model, tmp_path / "val", tmp_path / "scored.parquet"))
    for column in ("path", "category", LABEL_COLUMN):  # the same cells in the other format
        assert parquet[column].tolist() == _column(scored, column)

    unlabeled = _read_both_ways(score(model, raw, tmp_path / "raw.csv"))
    shown = os.fsencode(LATIN1).decode("utf-8", "backslashreplace") + ".png"  # caf\xe9.png
    expected = [f"{label}/{name}" for label in ODD_NAMES for name in [*per_class, shown]]
    assert sorted(_column(unlabeled, "path")) == sorted(expected)

    result = evaluate(tmp_path / "scored.csv", settings=project)
    report = _read_both_ways(result.paths["per_class_csv"])
    assert report[0] == ["class", "precision", "recall", "f1", "support", "roc_auc", "pr_auc"]
    assert sorted(_column(report, "class")) == sorted(ODD_NAMES)  # seven the model never learned


def test_trials_table_of_odd_values_reads_back_identically(tmp_path: Path) -> None:
    trials = [
        TrialOutcome(number=i, state="COMPLETE", value=0.5, values={"arch": name}, duration_s=1.0)
        for i, name in enumerate(ODD_NAMES)
    ]
    rows = trial_rows(trials, "val/top1", ["arch", "unset"])
    path = tmp_path / "trials.csv"
    path.write_bytes(trials_csv(rows).encode("utf-8"))  # as report_study writes it

    table = _read_both_ways(path)
    assert table[0] == [
        "number",
        "state",
        "val/top1",
        "arch",
        "unset",
        "duration_s",
        "mlflow_run_id",
    ]
    assert _column(table, "arch") == list(ODD_NAMES)
    assert _column(table, "unset") == [""] * len(ODD_NAMES)


class _JsonLines(TableFormat):
    """A toy format: one JSON object per row. One class and one registry line make it usable."""

    suffix = ".jsonl"

    def writer(self, path: Path, schema: pa.Schema) -> TableWriter:
        class Lines(TableWriter):
            def __init__(self) -> None:
                self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115

            def write(self, frame: pd.DataFrame) -> None:
                frame.to_json(
                    self.file, orient="records", lines=True, force_ascii=False, double_precision=15
                )

            def close(self) -> None:
                self.file.close()

        return Lines()

    def concatenate(self, parts: Sequence[Path], dest: Path) -> None:
        dest.write_bytes(b"".join(part.read_bytes() for part in parts))

    def read(
        self, path: Path, text: Sequence[str], columns: Sequence[str] | None = None
    ) -> pd.DataFrame:
        frame = pd.read_json(path, lines=True, dtype=dict.fromkeys(text, str))
        return frame if columns is None else frame[list(columns)]


def test_a_new_table_format_is_one_class_and_one_registry_line(
    exported_model: Path,
    digits_split: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, val = digits_split
    reference = score(exported_model, val, tmp_path / "scores.csv")
    with pytest.raises(InvalidParameterError, match=r"must end in \.csv or \.parquet"):
        score(exported_model, val, tmp_path / "scores.jsonl")
    monkeypatch.setitem(TABLE_FORMATS, ".jsonl", _JsonLines())

    lines = score(exported_model, val, tmp_path / "scores.jsonl")  # score writes it
    sharded = score_in_shards(exported_model, val, tmp_path / "merged.jsonl", shard_images=7)

    def read(table: Path) -> pd.DataFrame:
        return table_format(table).read(table, ["path", "category", LABEL_COLUMN])

    expected = read(reference)
    assert len(expected) > 7  # so the merge joined several shards
    for table in (lines, sharded):
        got = read(table)  # the probabilities and labels as scored
        assert got["path"].tolist() == expected["path"].tolist()
        assert got[LABEL_COLUMN].tolist() == expected[LABEL_COLUMN].tolist()
        probabilities = [c for c in expected.columns if c.startswith(PROBABILITY_PREFIX)]
        assert (got[probabilities] - expected[probabilities]).abs().max().max() < 1e-12
    # evaluate reads the new format whole (it has no read_chunks of its own), to the same metrics
    assert table_metrics(sharded).metrics == pytest.approx(compute_metrics(expected).metrics)
