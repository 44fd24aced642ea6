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

from models.atomic import check_name_length
from models.directory import ONNX, ONNX_INT8, ModelInfo, read_model_info
from tasks.data.imagedir import IMAGE_EXTENSIONS
from tasks.data.transform import transform_for
from tasks.inference.score.images import applied_transform, list_slice
from tasks.inference.score.readers import read_batches, reader_processes
from tasks.inference.score.rows import BatchScorer, scored_in_order, scored_table
from tasks.inference.score.session import (
    batch_time_limit,
    check_model,
    default_threads,
    inference_session,
    runs_at_once,
)
from tasks.inference.score.table import ERROR_COLUMN, table_schema
from tasks.inference.tables import TableFormat, table_format
from tasks.shared import faults
from tasks.shared.errors import (
    InvalidModelDirectoryError,
    InvalidParameterError,
    NoUsableImagesError,
)
from tasks.shared.fork_server import start_fork_server
from tasks.shared.object_store import S3Url
from tasks.shared.step import step, step_logger, tasks_on_first_use

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


def checked_scoring(
    model: Path, dest: Path | S3Url, batch_size: int, threads: int | None, quantized: bool
) -> tuple[TableFormat, ModelInfo, Path]:
    """(the table's format, the model's info, its ONNX file), or the error of a scoring that
    cannot start: refused before any image is read, on one machine or on a cluster."""
    if batch_size < 1:
        raise InvalidParameterError(f"batch_size must be >= 1, got {batch_size}.")
    if threads is not None and threads < 1:
        raise InvalidParameterError(
            f"threads must be >= 1 (or unset for all cores), got {threads}."
        )
    table = table_format(Path(dest.name), "scored table")  # an S3 prefix: by its last name
    if isinstance(dest, Path):
        check_name_length(dest, "scored table")
    info = read_model_info(model)
    onnx_path = model / (ONNX_INT8 if quantized else ONNX)
    if not onnx_path.is_file():
        raise InvalidModelDirectoryError(
            f"{model} has no {onnx_path.name}.",
            f"Run `imageops quantize {model} TRAIN VAL` first."
            if quantized
            else f"Run `imageops export {model}` first.",
        )
    return table, info, onnx_path


def score(
    model: Path,
    images: Path | S3Url,
    dest: Path | S3Url,
    *,
    batch_size: int = 64,
    threads: int | None = None,
    quantized: bool = False,
    shard: tuple[int, int] | None = None,
) -> Path | S3Url:
    """Score ``images`` with the exported ModelDirectory ``model``; write the table to ``dest``.

    ``images``: an ImageDirectory or any folder of images, here or as an ``s3://`` prefix;
    ``dest``: ``.csv`` or ``.parquet``, written atomically (an S3 object: uploaded whole) and
    returned; ``quantized``: the INT8 model; ``shard=(i, n)``: only the i-th
    of n slices. Every image gets a row (an unreadable one, or one the model returned NaN or
    infinite scores for, its reason in ``Scoring Error``). Raises NoUsableImagesError when no image
    could be scored, ScoringFailedError when ONNX Runtime fails or a batch runs past
    ``IMAGEOPS_SCORE_BATCH_TIMEOUT_S``. Details: docs/scoring.md#score.
    """
    model = Path(model)
    images = images if isinstance(images, S3Url) else Path(images)
    dest = dest if isinstance(dest, S3Url) else Path(dest)
    _, info, onnx_path = checked_scoring(model, dest, batch_size, threads, quantized)
    time_limit = batch_time_limit()
    cores = threads or default_threads()
    readers = reader_processes(cores)
    runs = runs_at_once(cores)
    start_fork_server()  # the readers' server imports torch while the images are listed
    refs, labeled, first, total = list_slice(
        images, lambda total: (0, total) if shard is None else shard_bounds(total, *shard)
    )
    if not total:
        raise NoUsableImagesError(
            f"No image found in {images}.",
            f"Scoring reads these extensions: {' '.join(IMAGE_EXTENSIONS)}.",
        )
    transform = transform_for(info.transform, "inference", images, applied_transform(images))
    # The readers start first: they decode the first batches while the session is made.
    with read_batches(refs, batch_size, transform, readers) as read:
        session = inference_session(onnx_path, cores // runs)
        check_model(session, info, onnx_path)
        log = step_logger(LOGGER)
        provider = session.get_providers()[0]
        log.info("Scoring %d image(s) with %s on %s", len(refs), onnx_path, provider)
        if labeled:
            unknown = sorted({r.category for r in refs} - set(info.classes))
            if unknown:
                log.warning("Classes the model does not know (always scored wrong): %s", unknown)
        scorer = BatchScorer(session, info.classes, time_limit, onnx_path)
        table = scored_table(dest, table_schema(info.classes, labeled), images, shard is None, log)
        with table as rows, _progress(len(refs)) as progress:
            bar = progress.add_task("Scoring", total=len(refs)) if progress else None
            for start, batch, errors, probs, labels in scored_in_order(read, scorer, runs):
                ids = np.arange(first + start, first + start + len(batch))
                rows.write(ids, batch, errors, probs, labels)
                if bar is not None:
                    progress.advance(bar, len(batch))
    scored, failed = rows.scored, rows.rows - rows.scored
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
