"""What a scoring run shows in the Prefect UI: the model and version, counts, where the table is.

A scored table can hold millions of rows: it is counted a chunk at a time (memory follows the
chunk), reading only the label and error columns where the format allows.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tasks.inference.score.table import ERROR_COLUMN, LABEL_COLUMN, TRUE_LABEL_COLUMN
from tasks.inference.tables import table_format
from tasks.shared.artifacts import markdown_table
from tasks.shared.object_store import S3Url

COUNTED_ROWS = 100_000  # rows per chunk
SHOWN_LABELS = 10  # the most predicted classes listed


@dataclass
class TableCounts:
    """Rows of a scored table: scored, unreadable, and how many got each label."""

    rows: int = 0
    unreadable: int = 0
    labels: Counter = field(default_factory=Counter)
    labelled: int = 0  # scored rows of images with a true class (an ImageDirectory's)
    correct: int = 0  # of those, the ones whose scored label is it


def table_counts(path: Path | S3Url) -> TableCounts:
    counts = TableCounts()
    if isinstance(path, S3Url):  # a part at a time, as its marker lists them
        from tasks.inference.score.s3_table import read_parts

        counted = [LABEL_COLUMN, ERROR_COLUMN, TRUE_LABEL_COLUMN]
        chunks = read_parts(path, counted, text=counted)  # not the probabilities
    else:
        chunks = table_format(path, "scored table").read_chunks(
            path, [LABEL_COLUMN, ERROR_COLUMN, TRUE_LABEL_COLUMN], COUNTED_ROWS, leave_out=["id"]
        )
    for chunk in chunks:
        counts.rows += len(chunk)
        failed = (
            chunk[ERROR_COLUMN].fillna("").astype(str) != ""
            if ERROR_COLUMN in chunk.columns
            else None
        )
        if failed is not None:
            counts.unreadable += int(failed.sum())
            chunk = chunk[~failed]
        counts.labels.update(chunk[LABEL_COLUMN].astype(str).tolist())
        if TRUE_LABEL_COLUMN in chunk.columns:
            counts.labelled += len(chunk)
            hits = chunk[TRUE_LABEL_COLUMN].astype(str) == chunk[LABEL_COLUMN].astype(str)
            counts.correct += int(hits.sum())
    return counts


def score_markdown(
    model: str, version: int | None, version_url: str | None, images: str, scored: Path | S3Url
) -> str:
    """The scoring run's report: what scored what, how many, and the table's path."""
    counts = table_counts(scored)
    if version is not None:
        name = f"version {version}"
        model_cell = f"`{model}`: [{name}]({version_url})" if version_url else f"`{model}` ({name})"
    else:
        model_cell = f"`{model}`"
    top = ", ".join(
        f"{label}: {count:,}" for label, count in counts.labels.most_common(SHOWN_LABELS)
    )
    more = len(counts.labels) - SHOWN_LABELS
    rows = [
        ("model", model_cell),
        ("images", f"`{images}`"),
        ("rows", f"{counts.rows:,}"),
        ("scored", f"{counts.rows - counts.unreadable:,}"),
        ("unreadable (a row with its reason)", f"{counts.unreadable:,}"),
        ("predicted", top + (f" (and {more} more classes)" if more > 0 else "")),
    ]
    if counts.labelled:  # an ImageDirectory's images carry their class: how many were right
        accuracy = counts.correct / counts.labelled
        right = f"{accuracy:.4f} ({counts.correct:,} of {counts.labelled:,} labelled images)"
        rows.append(("accuracy", right))
    rows.append(("table", f"`{scored}`"))
    table = markdown_table([{"scoring": what, "this run": value} for what, value in rows])
    return f"### Scoring\n\n{table}\n"
