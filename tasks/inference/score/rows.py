"""A batch's rows of the scored table: the model's scores as probabilities and labels, and every
image that could not be scored as a row with its reason; and the table they go into, written
whole. One way, on one machine and on a cluster.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pandas as pd
import pyarrow as pa

from tasks.inference.score.images import ImageRef
from tasks.inference.score.session import run_batch, softmax, unusable_scores
from tasks.inference.score.table import (
    ERROR_COLUMN,
    LABEL_COLUMN,
    NOT_SCORED_HINT,
    PROBABILITY_PREFIX,
    TRUE_LABEL_COLUMN,
    table_file,
)
from tasks.inference.tables import table_format
from tasks.shared.errors import NoUsableImagesError
from tasks.shared.object_store import S3Url


@dataclass(frozen=True)
class BatchScorer:
    """One ONNX Runtime session scoring batches into rows: its model's classes, its time limit."""

    session: ort.InferenceSession
    classes: Sequence[str]
    time_limit: float
    onnx_path: Path

    def scores(
        self,
        images: np.ndarray | None,
        kept: list[int],
        errors: list[str],
    ) -> tuple[np.ndarray, np.ndarray]:
        """(probabilities, labels) of a batch of ``len(errors)`` images, ``images`` those of the
        images ``kept``, stacked (None when none is); an image whose scores are unusable gets its
        reason in ``errors``. Rows not scored: NaN, ""."""
        classes = np.asarray(self.classes, dtype=object)
        probs = np.full((len(errors), len(classes)), np.nan)
        labels = np.full(len(errors), "", dtype=object)
        if images is None or not kept:
            return probs, labels
        logits = run_batch(self.session, images, len(classes), self.time_limit, self.onnx_path)
        for i, reason in zip(kept, unusable_scores(logits), strict=True):
            if reason:
                errors[i] = reason
        usable = [row for row, i in enumerate(kept) if not errors[i]]
        kept = [kept[row] for row in usable]
        probs[kept] = softmax(logits[usable])
        labels[kept] = classes[probs[kept].argmax(axis=1)]
        return probs, labels


def scored_in_order(
    read: Iterable[tuple[int, list[ImageRef], np.ndarray | None, list[int], list[str]]],
    scorer: BatchScorer,
    runs: int,
) -> Iterator[tuple[int, list[ImageRef], list[str], np.ndarray, np.ndarray]]:
    """Each batch of ``read`` scored: (its start, its refs, its errors, probabilities, labels), in
    the order read, with up to ``runs`` batches in the session at once (ONNX Runtime runs them
    side by side, the GIL released).

    Two runs of one thread each beat one run of two threads beside the readers: a run's threads
    meet after every operator, and a reader taking one thread's core made the other wait (64 px on
    2 cores: docs/scoring.md#readers). A batch left in flight when the caller stops (an error,
    Ctrl-C) is cancelled, or finished before this returns.
    """
    if runs <= 1:
        for start, batch, stacked, kept, errors in read:
            yield start, batch, errors, *scorer.scores(stacked, kept, errors)
        return
    with ThreadPoolExecutor(runs, thread_name_prefix="imageops-score") as pool:
        pending: deque = deque()
        try:
            for start, batch, stacked, kept, errors in read:
                pending.append(
                    (start, batch, errors, pool.submit(scorer.scores, stacked, kept, errors))
                )
                if len(pending) >= runs:
                    start, batch, errors, scores = pending.popleft()
                    yield start, batch, errors, *scores.result()
            while pending:
                start, batch, errors, scores = pending.popleft()
                yield start, batch, errors, *scores.result()
        finally:
            for *_, scores in pending:
                scores.cancel()


@dataclass
class TableRows:
    """The rows written so far into a table being written (:func:`scored_table`); each image not
    scored is logged with its reason as its row is written, so both paths log it alike, in the
    images' order."""

    writer: Any  # the table format's writer
    columns: list[str]
    log: logging.Logger | logging.LoggerAdapter
    rows: int = 0
    scored: int = 0  # rows without an error

    def write(
        self,
        ids: np.ndarray,
        refs: Sequence[ImageRef],
        errors: list[str],
        probs: np.ndarray,
        labels: np.ndarray,
    ) -> None:
        """Write a batch: the images ``refs`` at places ``ids`` of the listing, each with its
        error ("" when scored) and its scores (NaN and "" when not)."""
        for ref, error in zip(refs, errors, strict=True):
            if error:
                self.log.warning("Cannot score %s: %s", ref.path, error)
        data = {
            "id": np.asarray(ids, dtype=np.int64),
            "path": [r.path for r in refs],
            TRUE_LABEL_COLUMN: [r.category for r in refs],
            ERROR_COLUMN: errors,
        }
        scores = [c for c in self.columns if c.startswith(PROBABILITY_PREFIX)]
        data |= {column: probs[:, i] for i, column in enumerate(scores)}
        data[LABEL_COLUMN] = labels
        self.writer.write(pd.DataFrame({c: data[c] for c in self.columns}, columns=self.columns))
        self.rows += len(errors)
        self.scored += sum(1 for error in errors if not error)


@contextlib.contextmanager
def scored_table(
    dest: Path | S3Url,
    schema: pa.Schema,
    images: Path | S3Url,
    whole: bool,
    log: logging.Logger | logging.LoggerAdapter,
) -> Iterator[TableRows]:
    """Write the table ``dest`` (atomically, or uploaded whole: :func:`table_file`) from the rows
    the block writes. ``whole``: the whole input's table, refused (NoUsableImagesError, nothing
    written) when no row was scored; a shard's table may hold only error rows."""
    with table_file(dest) as tmp:
        rows = TableRows(table_format(Path(dest.name)).writer(tmp, schema), schema.names, log)
        try:
            yield rows
        finally:
            rows.writer.close()
        if whole and not rows.scored:
            raise NoUsableImagesError(
                f"None of the {rows.rows} image(s) in {images} could be scored.", NOT_SCORED_HINT
            )
