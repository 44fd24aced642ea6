"""Score Image Model: run a model's ``model.onnx`` over a folder of images, in batches.

The images go through the inference mode of the transform spec the model was trained with
(:func:`tasks.transform.build_transform`), so scoring sees exactly what training validated on.
Images are read, scored and written a batch at a time: memory stays flat however large the
folder, and the table grows on disk in a temporary file that replaces ``dest`` only when every
batch is done. An image that does not load, or is over the limits convert applies (pixels,
aspect ratio, file size: ``ImageExceedsLimit``, found from the header before anything is
decoded), becomes a row with empty scores and the reason in ``Scoring Error`` (and a log line);
it never fails the batch. A large input is cut into shards
that parallel Prefect tasks score and :func:`merge_tables` joins in order
(:func:`score_in_shards`). The shard is the unit of resumption: finished shard tables are kept
beside ``dest`` until the merge, so a run killed mid-way and started again scores only the shards
it had not finished; a smaller input (one shard, ``SHARD_IMAGES``) is scored again from the start.

The output is the Score Image Model table: ``id`` (the image's place in the listing), ``path``,
``category`` (the true class, only when the input is labeled), ``Scoring Error``, one
``Scored Probabilities_<class>`` column per class (softmax), then ``Scored Labels``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pandas as pd
import pyarrow as pa

from models.atomic import atomic_file, check_name_length, remove_leftovers, scratch_folder
from models.directory import ONNX, ONNX_INT8, ModelInfo, read_model_info
from models.untrained import MODEL_JSON
from tasks import faults
from tasks.errors import (
    ImageOpsError,
    InvalidModelDirectoryError,
    InvalidParameterError,
    NoUsableImagesError,
)
from tasks.export import INPUT_NAME, OUTPUT_NAME, sha256_file
from tasks.imagedir import (
    IMAGE_EXTENSIONS,
    MANIFEST,
    ImageRefused,
    SkipReason,
    is_image_file,
    is_utf8,
    load_rgb,
    printable_name,
    read_manifest,
)
from tasks.step import step, step_logger
from tasks.tables import table_format
from tasks.transform import applied_to, input_size, transform_for

PROBABILITY_PREFIX = "Scored Probabilities_"
LABEL_COLUMN = "Scored Labels"
ERROR_COLUMN = "Scoring Error"  # empty when the image was scored; else why it could not be


@dataclass(frozen=True)
class ImageRef:
    """One image to score: where it is, how the table names it, its true class if known."""

    file: Path
    path: str
    category: str | None
    problem: str = ""  # why it is not scored, found before reading it (an error row)


def list_images(images: Path) -> tuple[list[ImageRef], bool]:
    """The images to score, in a stable order, and whether they are labeled.

    An ImageDirectory is read from its manifest (labeled ones carry the true class); any other
    folder is walked recursively for image extensions, hidden files left out, and is unlabeled.
    """
    images = Path(images)
    if not images.is_dir():
        raise NoUsableImagesError(
            f"{images} is not a folder.", "Pass an ImageDirectory or a folder of images."
        )
    if (images / MANIFEST).is_file():
        manifest = read_manifest(images)
        refs = [
            ImageRef(
                file=images / entry.path,
                path=entry.path,
                category=manifest.classes[entry.label] if manifest.labeled else None,
            )
            for entry in manifest.images
        ]
        return refs, manifest.labeled
    files = sorted(
        p
        for p in images.rglob("*")
        if p.is_file()
        and is_image_file(p)
        and not any(part.startswith(".") for part in p.relative_to(images).parts)
    )
    return [_raw_ref(p, p.relative_to(images).as_posix()) for p in files], False


def _raw_ref(file: Path, rel: str) -> ImageRef:
    """A raw folder's image; one whose name is not UTF-8 (the table is UTF-8) becomes an error
    row under its name with the odd bytes as ``\\xNN``, so every other image is still scored."""
    if is_utf8(rel):
        return ImageRef(file=file, path=rel, category=None)
    reason = SkipReason.BAD_FILE_NAME.because(
        "the name is not UTF-8, so the table cannot hold it; rename the file"
    )
    return ImageRef(file=file, path=printable_name(rel), category=None, problem=reason)


def default_threads() -> int:
    """The cores this process may run on (the container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def inference_session(onnx_path: Path, threads: int | None = None) -> ort.InferenceSession:
    """An ONNX Runtime session tuned for batch scoring.

    All graph optimisations; intra-op threads = the cores we may use (ORT's default can count the
    host's cores inside a container); CUDA first when this onnxruntime build has it, CPU always
    as the fallback.
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = threads or default_threads()
    providers = ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    return ort.InferenceSession(str(onnx_path), sess_options=options, providers=providers)


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def _check_model(session: ort.InferenceSession, info: ModelInfo, onnx_path: Path) -> None:
    """Refuse a model.json that does not describe this model.onnx, before any image is read."""
    (inp,) = session.get_inputs()
    (out,) = session.get_outputs()
    side = input_size(info.transform)
    hint = "Export the model again so model.onnx and model.json agree."
    if inp.shape[1:] != [3, side, side]:
        raise InvalidModelDirectoryError(
            f"{onnx_path} takes input {inp.shape}, but model.json's transform makes "
            f"{side}x{side} images.",
            hint,
        )
    if out.shape[-1] != len(info.classes):
        raise InvalidModelDirectoryError(
            f"{onnx_path} returns {out.shape[-1]} scores, but model.json lists "
            f"{len(info.classes)} classes.",
            hint,
        )


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


def table_schema(classes: Sequence[str], labeled: bool) -> pa.Schema:
    """The Score Image Model table's columns, in order, with their types."""
    fields = [pa.field("id", pa.int64()), pa.field("path", pa.string())]
    if labeled:
        fields.append(pa.field("category", pa.string()))
    fields.append(pa.field(ERROR_COLUMN, pa.string()))
    fields += [pa.field(f"{PROBABILITY_PREFIX}{c}", pa.float64()) for c in classes]
    fields.append(pa.field(LABEL_COLUMN, pa.string()))
    return pa.schema(fields)


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

    ``images``: an ImageDirectory (labeled: the true ``category`` is passed through) or any folder
    of images (searched recursively). ``dest`` ends in ``.csv`` or ``.parquet``. ``threads``:
    ONNX Runtime intra-op threads (default: the cores available). ``quantized``: score with
    ``model.int8.onnx`` (the quantize step's INT8 model) instead of ``model.onnx``. Returns
    ``dest``, written atomically. ``shard=(i, n)`` scores only the i-th of n equal, contiguous
    slices of the images (ids stay those of the whole listing), for :func:`score_in_shards`.

    Every image gets a row: one that cannot be read has empty scores and its reason in
    ``Scoring Error``. Raises NoUsableImagesError when no image could be scored (a shard is
    checked when the shards are merged).
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
    _check_model(session, info, onnx_path)
    log = step_logger(__name__)
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
                probs = np.full((len(batch), len(classes)), np.nan)
                labels = np.full(len(batch), "", dtype=object)
                if kept:
                    (logits,) = session.run([OUTPUT_NAME], {INPUT_NAME: np.stack(tensors)})
                    probs[kept] = _softmax(logits)
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


score_task = step(score, name="score")
SHARD_IMAGES = 20_000  # a shard per this many images: big enough that start-up is noise
CHECKPOINTS = ".imageops-shards"  # beside the scored table: finished shards of unmerged runs
# The kind of a private shard folder (.<table>.shards-<8>): a run that cannot share the checkpoint.
SCRATCH = "shards"
CHECKPOINT_FORMAT = 2  # part of the checkpoint key: raise it when a shard table changes shape


def merge_tables(parts: Sequence[Path], dest: Path) -> int:
    """Concatenate the shard tables ``parts`` into ``dest`` in the order given, atomically.

    Streams (a row group or a block of lines at a time), so memory stays flat. Returns how many
    rows were scored (not failed). Raises NoUsableImagesError when none was.
    """
    dest = Path(dest)
    table = table_format(dest, "scored table")
    scored = rows = 0
    with atomic_file(dest) as tmp:
        table.concatenate(parts, tmp)
        for part in parts:
            errors = table.read(part, [ERROR_COLUMN], columns=[ERROR_COLUMN])[ERROR_COLUMN]
            scored += int((errors == "").sum())
            rows += len(errors)
        if not scored:
            raise NoUsableImagesError(
                f"None of the {rows} image(s) could be read; nothing scored.",
                "Check the files open in an image viewer (the log names each one).",
            )
    return scored


def checkpoint_dir(
    model: Path,
    refs: Sequence[ImageRef],
    labeled: bool,
    dest: Path,
    *,
    shard_images: int,
    batch_size: int,
    quantized: bool,
) -> Path:
    """Where :func:`score_in_shards` keeps the finished shard tables of this exact scoring.

    The folder (under ``CHECKPOINTS`` beside ``dest``) is named by a digest of everything that
    decides the tables: the model files used, the image listing (path, size, mtime of each file,
    class), the shard and batch sizes and the format; never ``dest``'s name, so a rerun under a
    new name resumes too. A change to any of them is another folder: nothing stale is reused.
    """
    model = Path(model)
    onnx_path = model / (ONNX_INT8 if quantized else ONNX)
    digest = hashlib.sha256()
    for path in (onnx_path, model / MODEL_JSON):  # model.json holds the classes and transform
        digest.update(sha256_file(path).encode() if path.is_file() else b"-")
    settings = [CHECKPOINT_FORMAT, quantized, labeled, shard_images, batch_size]
    digest.update(json.dumps([*settings, Path(dest).suffix.lower()]).encode())
    for ref in refs:
        try:
            stat = ref.file.stat()
            seen = [stat.st_size, stat.st_mtime_ns]
        except OSError:  # scored as an error row; a file that appears later changes the key
            seen = None
        digest.update(json.dumps([ref.path, ref.category, seen]).encode())
    return Path(dest).parent / CHECKPOINTS / digest.hexdigest()[:20]


def _claim(folder: Path) -> int | None:
    """Lock ``folder`` for this process: the locked descriptor, or None if another holds it.

    Two scorings of the same model on the same images into one folder would share the shard
    tables and remove them under each other. ``flock`` is released by the kernel however its
    holder ends, so the checkpoint of a killed run is free at once.
    """
    while True:
        with contextlib.suppress(FileNotFoundError):  # a finished run removed it meanwhile: again
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # Locked: but the run we waited for may have removed the folder before it let go.
                if os.path.samestat(os.fstat(fd), os.stat(folder)):
                    return fd
            except BlockingIOError:
                os.close(fd)
                return None
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)


def _discard(folder: Path) -> None:
    """Remove a checkpoint folder, and the checkpoints' folder once no other run's is left."""
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        folder.parent.rmdir()


def score_in_shards(
    model: Path,
    images: Path,
    dest: Path,
    *,
    shard_images: int = SHARD_IMAGES,
    batch_size: int = 64,
    threads: int | None = None,
    quantized: bool = False,
) -> Path:
    """:func:`score` for inputs of any size: shards of ``shard_images`` scored in parallel.

    Called from a flow, each shard is a ``score`` task submitted to the flow's task runner (ONNX
    Runtime and image decoding release the GIL, so threads run side by side), the cores split
    between them; outside a flow the shards run one after another. The shard tables are merged
    in shard order, so the result is the same table :func:`score` writes, whatever finished
    first. An input of one shard is scored directly.

    Each shard table is written atomically into :func:`checkpoint_dir` and kept until the merge
    succeeds: a run that was killed, or failed, and is started again with the same model, images
    and settings scores only the missing shards (it logs how many it reused).
    """
    from prefect.futures import wait

    from tasks.step import in_prefect_run

    if shard_images < 1:
        raise InvalidParameterError(f"shard_images must be >= 1, got {shard_images}.")
    dest = Path(dest)
    check_name_length(dest, "scored table")  # before the checkpoint folder is made beside it
    refs, labeled = list_images(images)
    total = len(refs)
    count = max(1, -(-total // shard_images))
    kwargs = {"batch_size": batch_size, "quantized": quantized}
    remove_leftovers(dest, SCRATCH)  # a killed run's private shards: they are never resumed
    if count == 1:
        run = score_task if in_prefect_run() else score
        return run(model, images, dest, threads=threads, **kwargs)
    log = step_logger(__name__)
    folder = checkpoint_dir(model, refs, labeled, dest, shard_images=shard_images, **kwargs)
    lock = _claim(folder)
    private = contextlib.ExitStack()
    if lock is None:
        folder = private.enter_context(scratch_folder(dest, SCRATCH))
        log.info("Another run is scoring the same images beside %s; not sharing its shards", dest)
    parts = [folder / f"{i:05d}{dest.suffix}" for i in range(count)]
    resumable = True
    try:
        for stale in folder.glob(".*.tmp"):  # a killed run's half-written shard
            stale.unlink(missing_ok=True)
        missing = [i for i, part in enumerate(parts) if not part.is_file()]
        if len(missing) < count:
            log.warning(
                "Reusing %d of %d finished shards from an interrupted run in %s",
                count - len(missing),
                count,
                folder,
            )
        if in_prefect_run():
            per_shard = max(1, (threads or default_threads()) // max(1, len(missing)))
            futures = [
                score_task.submit(
                    model, images, parts[i], shard=(i, count), threads=per_shard, **kwargs
                )
                for i in missing
            ]
            wait(futures)
            for future in futures:
                future.result()  # raises the first shard's error, if any
        else:
            for i in missing:
                score(model, images, parts[i], shard=(i, count), threads=threads, **kwargs)
        try:
            scored = merge_tables(parts, dest)
        except ImageOpsError:
            resumable = False  # a verdict on the finished shards: a rerun would only repeat it
            raise
        resumable = False
    finally:
        if lock is None:
            private.close()  # removes the private folder: it is never resumed
        else:
            if not (resumable and any(part.is_file() for part in parts)):
                _discard(folder)
            os.close(lock)  # only now: no other run may claim a folder that is being removed
    log.info("Scored %d of %d image(s) in %d shards into %s", scored, total, count, dest)
    return dest
