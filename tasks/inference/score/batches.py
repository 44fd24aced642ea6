"""Score Image Model's one pass: images read, scored and written a batch at a time.

Images go through the inference mode of the model's transform spec, so scoring sees what training
validated on. Memory stays flat: the table grows in a temporary file that replaces ``dest`` when
done. An image that does not load or is over convert's limits becomes a row with its reason in
``Scoring Error``; it never fails the batch. Details: docs/scoring.md#one-pass.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from models.atomic import atomic_file, check_name_length
from models.directory import ONNX, ONNX_INT8, read_model_info
from tasks.data.imagedir import IMAGE_EXTENSIONS, ImageRefused, load_rgb
from tasks.data.transform import applied_to, transform_for
from tasks.inference.export import INPUT_NAME, OUTPUT_NAME
from tasks.inference.score.images import ImageRef, list_images
from tasks.inference.score.session import check_model, inference_session, softmax
from tasks.inference.score.table import ERROR_COLUMN, LABEL_COLUMN, PROBABILITY_PREFIX, table_schema
from tasks.inference.tables import table_format
from tasks.shared import faults
from tasks.shared.errors import (
    InvalidModelDirectoryError,
    InvalidParameterError,
    NoUsableImagesError,
)
from tasks.shared.step import step, step_logger, tasks_on_first_use

LOGGER = "tasks.inference.score"  # one logger for the whole step, whichever module logs


def _batches(refs: list[ImageRef], size: int) -> Iterator[tuple[int, list[ImageRef]]]:
    for start in range(0, len(refs), size):
        yield start, refs[start : start + size]


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


def _read_batch(
    batch: Sequence[ImageRef],
    transform: Callable,
    log: logging.Logger | logging.LoggerAdapter,
) -> tuple[list[np.ndarray], list[int], list[str]]:
    """The batch's tensors, the places of the images they come from, and each image's error.

    An image that cannot be read gets its reason (and a log line) instead of a tensor.
    """
    tensors, kept, errors = [], [], [""] * len(batch)
    for i, ref in enumerate(batch):
        if ref.problem:
            errors[i] = ref.problem
            log.warning("Cannot score %s: %s", ref.path, ref.problem)
            continue
        try:
            tensors.append(transform(load_rgb(ref.file)).numpy())
        except ImageRefused as refused:  # over the limits convert applies too
            errors[i] = refused.reason
            log.warning("Cannot score %s: %s", ref.path, errors[i])
            continue
        except Exception as exc:  # one bad file must not sink the other images
            errors[i] = f"{type(exc).__name__}: {exc}"
            log.warning("Cannot score %s: %s", ref.path, errors[i])
            continue
        kept.append(i)
    return tensors, kept, errors


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
    of n slices. Every image gets a row (an unreadable one its reason in ``Scoring Error``). Raises
    NoUsableImagesError when no image could be scored. Details: docs/scoring.md#score.
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
    info = read_model_info(model)
    onnx_path = model / (ONNX_INT8 if quantized else ONNX)
    if not onnx_path.is_file():
        raise InvalidModelDirectoryError(
            f"{model} has no {onnx_path.name}.",
            f"Run `imageops quantize {model} TRAIN VAL` first."
            if quantized
            else f"Run `imageops export {model}` first.",
        )
    refs, labeled = list_images(images)
    if not refs:
        raise NoUsableImagesError(
            f"No image found in {images}.",
            f"Scoring reads these extensions: {' '.join(IMAGE_EXTENSIONS)}.",
        )
    first = 0
    if shard is not None:
        first, last = shard_bounds(len(refs), *shard)
        refs = refs[first:last]
    session = inference_session(onnx_path, threads)
    check_model(session, info, onnx_path)
    log = step_logger(LOGGER)
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
            for start, batch in _batches(refs, batch_size):
                tensors, kept, errors = _read_batch(batch, transform, log)
                probs = np.full((len(batch), len(classes)), np.nan)
                labels = np.full(len(batch), "", dtype=object)
                if kept:
                    (logits,) = session.run([OUTPUT_NAME], {INPUT_NAME: np.stack(tensors)})
                    probs[kept] = softmax(logits)
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
                f"None of the {len(refs)} image(s) in {images} could be read; nothing scored.",
                "Check the files open in an image viewer (the log names each one).",
            )
    log.info("Scored %d image(s) into %s (%d could not be read)", scored, dest, failed)
    if shard is not None:
        faults.point("score.shard_written", shard=shard[0], count=shard[1])
    return dest


__getattr__ = tasks_on_first_use(
    globals(),
    score_task=lambda: step(score, name="score"),
)
