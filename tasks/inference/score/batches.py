"""Score Image Model's one pass: images read, scored and written a batch at a time.

Images go through the inference mode of the model's transform spec, so scoring sees what training
validated on. Memory stays flat: the table grows in a temporary file that replaces ``dest`` when
done. An image that does not load or is over convert's limits becomes a row with its reason in
``Scoring Error``; it never fails the batch. Details: docs/scoring.md#one-pass.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from models.atomic import atomic_file, check_name_length
from models.directory import ONNX, ONNX_INT8, read_model_info
from tasks.data.imagedir import IMAGE_EXTENSIONS
from tasks.data.transform import applied_to, transform_for
from tasks.inference.score.images import list_slice
from tasks.inference.score.readers import read_batches, reader_processes
from tasks.inference.score.session import (
    batch_time_limit,
    check_model,
    default_threads,
    inference_session,
    run_batch,
    softmax,
    unusable_scores,
)
from tasks.inference.score.table import (
    ERROR_COLUMN,
    LABEL_COLUMN,
    NOT_SCORED_HINT,
    PROBABILITY_PREFIX,
    table_schema,
)
from tasks.inference.tables import table_format
from tasks.shared import faults
from tasks.shared.errors import (
    InvalidModelDirectoryError,
    InvalidParameterError,
    NoUsableImagesError,
)
from tasks.shared.step import step, step_logger, tasks_on_first_use
from tasks.train.fork_server import start_fork_server

LOGGER = "tasks.inference.score"  # one logger for the whole step, whichever module logs


def shard_bounds(total: int, index: int, count: int) -> tuple[int, int]:
    """``[first, last)`` of the ``index``-th of ``count`` contiguous, near-equal slices."""
    if count < 1 or not 0 <= index < count:
        raise InvalidParameterError(
            f"shard must be (index, count) with 0 <= index < count, got ({index}, {count})."
        )
    return total * index // count, total * (index + 1) // count


def _progress(total: int) -> contextlib.AbstractContextManager:
    """A rich progress bar when a person is watching stderr; nothing in logs and CI."""
    if not sys.stderr.isatty():
        return contextlib.nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )


def score(
    model: Path,
    images: Path,
    dest: Path,
    *,
    batch_size: int = 64,
    threads: int | None = None,
    quantized: bool = False,
    shard: tuple[int, int] | None = None,
) -> Path:
    """Score ``images`` with the exported ModelDirectory ``model``; write the table to ``dest``.

    ``images``: an ImageDirectory or any folder of images; ``dest``: ``.csv`` or ``.parquet``,
    written atomically and returned; ``quantized``: the INT8 model; ``shard=(i, n)``: only the i-th
    of n slices. Every image gets a row (an unreadable one, or one the model returned NaN or
    infinite scores for, its reason in ``Scoring Error``). Raises NoUsableImagesError when no image
    could be scored, ScoringFailedError when ONNX Runtime fails or a batch runs past
    ``IMAGEOPS_SCORE_BATCH_TIMEOUT_S``. Details: docs/scoring.md#score.
    """
    model, images, dest = Path(model), Path(images), Path(dest)
    if batch_size < 1:
        raise InvalidParameterError(f"batch_size must be >= 1, got {batch_size}.")
    if threads is not None and threads < 1:
        raise InvalidParameterError(
            f"threads must be >= 1 (or unset for all cores), got {threads}."
        )
    table = table_format(dest, "scored table")
    check_name_length(dest, "scored table")
    time_limit = batch_time_limit()
    info = read_model_info(model)
    onnx_path = model / (ONNX_INT8 if quantized else ONNX)
    if not onnx_path.is_file():
        raise InvalidModelDirectoryError(
            f"{model} has no {onnx_path.name}.",
            f"Run `imageops quantize {model} TRAIN VAL` first."
            if quantized
            else f"Run `imageops export {model}` first.",
        )
    readers = reader_processes(threads or default_threads())
    start_fork_server()  # the readers' server imports torch while the images are listed
    refs, labeled, first, total = list_slice(
        images, lambda total: (0, total) if shard is None else shard_bounds(total, *shard)
    )
    if not total:
        raise NoUsableImagesError(
            f"No image found in {images}.",
            f"Scoring reads these extensions: {' '.join(IMAGE_EXTENSIONS)}.",
        )
    session = inference_session(onnx_path, threads)
    check_model(session, info, onnx_path)
    log = step_logger(LOGGER)
    log.info("Scoring %d image(s) with %s on %s", len(refs), onnx_path, session.get_providers()[0])
    if labeled:
        unknown = sorted({r.category for r in refs} - set(info.classes))
        if unknown:
            log.warning("Classes the model does not know (always scored wrong): %s", unknown)

    transform = transform_for(info.transform, "inference", images, applied_to(images))
    prob_columns = [f"{PROBABILITY_PREFIX}{c}" for c in info.classes]
    schema = table_schema(info.classes, labeled)
    columns = schema.names
    classes = np.asarray(info.classes, dtype=object)
    scored, failed = 0, 0
    with atomic_file(dest) as tmp, _progress(len(refs)) as progress:
        bar = progress.add_task("Scoring", total=len(refs)) if progress else None
        writer = table.writer(tmp, schema)
        try:
            # Reader processes decode the next batches beside ONNX Runtime's threads.
            read = read_batches(refs, batch_size, transform, readers, log)
            for start, batch, images, kept, errors in read:
                probs = np.full((len(batch), len(classes)), np.nan)
                labels = np.full(len(batch), "", dtype=object)
                if images is not None:
                    logits = run_batch(session, images, len(classes), time_limit, onnx_path)
                    for i, reason in zip(kept, unusable_scores(logits), strict=True):
                        if reason:
                            errors[i] = reason
                            log.warning("Cannot score %s: %s", batch[i].path, reason)
                    usable = [row for row, i in enumerate(kept) if not errors[i]]
                    kept = [kept[row] for row in usable]
                    probs[kept] = softmax(logits[usable])
                    labels[kept] = classes[probs[kept].argmax(axis=1)]
                data = {
                    "id": np.arange(first + start, first + start + len(batch), dtype=np.int64),
                    "path": [r.path for r in batch],
                    "category": [r.category for r in batch],
                    ERROR_COLUMN: errors,
                }
                data |= {col: probs[:, i] for i, col in enumerate(prob_columns)}
                data[LABEL_COLUMN] = labels
                writer.write(pd.DataFrame({c: data[c] for c in columns}, columns=columns))
                scored += len(kept)
                failed += len(batch) - len(kept)
                if bar is not None:
                    progress.advance(bar, len(batch))
        finally:
            writer.close()
        if not scored and shard is None:
            raise NoUsableImagesError(
                f"None of the {len(refs)} image(s) in {images} could be scored.",
                NOT_SCORED_HINT,
            )
    log.info(
        "Scored %d image(s) into %s (%d not scored: see %s)", scored, dest, failed, ERROR_COLUMN
    )
    if shard is not None:
        faults.point("score.shard_written", shard=shard[0], count=shard[1])
    return dest


__getattr__ = tasks_on_first_use(
    globals(),
    score_task=lambda: step(score, name="score"),
)
