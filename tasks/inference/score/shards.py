"""Scoring a large input in shards, resumable: the shard is the unit of resumption.

Each shard is scored into its own table, kept beside ``dest`` (:func:`checkpoint_dir`) until
:func:`merge_tables` joins them in order, so a killed run started again scores only the shards it
lacks. The caller runs the missing ones: in turn here (:func:`run_in_turn`), or as Prefect tasks in
a flow. Details: docs/scoring.md#shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from models.atomic import check_name_length, remove_leftovers, scratch_folder
from models.directory import ONNX, ONNX_INT8
from models.locks import lock_fd
from models.untrained import MODEL_JSON
from tasks.inference.export import sha256_file
from tasks.inference.score.batches import LOGGER, score
from tasks.inference.score.images import ImageRef, list_images
from tasks.inference.score.session import sessions_reused
from tasks.inference.score.table import merge_tables
from tasks.shared.errors import ImageOpsError, InvalidParameterError
from tasks.shared.object_store import S3Url
from tasks.shared.step import step_logger

SHARD_IMAGES = 20_000  # a shard per this many images: big enough that start-up is noise
CHECKPOINTS = ".imageops-shards"  # beside the scored table: finished shards of unmerged runs
# The kind of a private shard folder (.<table>.shards-<8>): a run that cannot share the checkpoint.
SCRATCH = "shards"
CHECKPOINT_FORMAT = 2  # part of the checkpoint key: raise it when a shard table changes shape


@dataclass(frozen=True)
class ShardedScoring:
    """One scoring of ``images`` with ``model`` into ``dest``, and how to cut and run it.

    ``images`` and ``dest`` may be ``s3://`` prefixes (:mod:`tasks.inference.score.s3_table`).
    """

    model: Path
    images: Path | S3Url
    dest: Path | S3Url
    shard_images: int = SHARD_IMAGES
    batch_size: int = 64
    threads: int | None = None  # all the shards' together; default: the cores available
    quantized: bool = False


@dataclass(frozen=True)
class ShardJob:
    """The arguments of one :func:`score` call: a shard's table, or the whole input's."""

    model: Path
    images: Path | S3Url
    dest: Path | S3Url  # a table, or an S3 object the table is uploaded to whole
    shard: tuple[int, int] | None  # (index, count); None: the whole input straight into dest
    batch_size: int
    threads: int | None
    quantized: bool

    def arguments(self) -> dict:
        """Keyword arguments for :func:`score` (or its task); an S3 URL stays one."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


ShardRunner = Callable[[Sequence[ShardJob]], None]


def run_in_turn(jobs: Sequence[ShardJob]) -> None:
    """Score the jobs one after another, in this process, with one ONNX Runtime session."""
    with sessions_reused():
        for job in jobs:
            score(**job.arguments())


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

    The folder (under ``CHECKPOINTS`` beside ``dest``) is named by :func:`checkpoint_key`.
    """
    key = checkpoint_key(
        model,
        refs,
        labeled,
        Path(dest).suffix,
        shard_images=shard_images,
        batch_size=batch_size,
        quantized=quantized,
    )
    return Path(dest).parent / CHECKPOINTS / key


def checkpoint_key(
    model: Path,
    refs: Sequence[ImageRef],
    labeled: bool,
    suffix: str,
    *,
    shard_images: int,
    batch_size: int,
    quantized: bool,
) -> str:
    """The name of this exact scoring's finished shards: a digest of everything that decides the
    tables: the model files used, the image listing (path, size, mtime of each file, or size and
    ETag of each S3 object, class), the shard and batch sizes and the format (``suffix``); never
    the table's name, so a rerun under a new name resumes too. A change to any of them is another
    key: nothing stale is reused.
    """
    model = Path(model)
    onnx_path = model / (ONNX_INT8 if quantized else ONNX)
    digest = hashlib.sha256()
    for path in (onnx_path, model / MODEL_JSON):  # model.json holds the classes and transform
        digest.update(sha256_file(path).encode() if path.is_file() else b"-")
    settings = [CHECKPOINT_FORMAT, quantized, labeled, shard_images, batch_size]
    digest.update(json.dumps([*settings, suffix.lower()]).encode())
    for ref in refs:
        digest.update(json.dumps([ref.path, ref.category, _seen(ref)]).encode())
    return digest.hexdigest()[:20]


def _seen(ref: ImageRef) -> list[int] | str | None:
    """What the checkpoint key trusts of an image, without reading it: its listed stamp (S3), or
    its file's size and mtime (None: missing; it is an error row, and appearing changes the key)."""
    if ref.stamp is not None:
        return ref.stamp
    try:
        stat = Path(ref.file).stat()
    except OSError:
        return None
    return [stat.st_size, stat.st_mtime_ns]


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
                if not lock_fd(fd, wait=False):
                    os.close(fd)
                    return None
                # Locked: but the run we waited for may have removed the folder before it let go.
                if os.path.samestat(os.fstat(fd), os.stat(folder)):
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)


def _discard(folder: Path) -> None:
    """Remove a checkpoint folder, and the checkpoints' folder once no other run's is left."""
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        folder.parent.rmdir()


def score_sharded(scoring: ShardedScoring, run_shards: ShardRunner = run_in_turn) -> Path | S3Url:
    """:func:`score` for inputs of any size: the shards missing from the checkpoint are scored by
    ``run_shards``, then merged in shard order, so the result is the table :func:`score` writes,
    whatever finished first. An input of one shard is one job that writes ``dest`` itself.

    Each shard table is written atomically into :func:`checkpoint_dir` and kept until the merge
    succeeds: a run that was killed, or failed, and is started again with the same model, images
    and settings scores only the missing shards (it logs how many it reused).
    """
    if scoring.shard_images < 1:
        raise InvalidParameterError(f"shard_images must be >= 1, got {scoring.shard_images}.")
    if isinstance(scoring.dest, S3Url):
        from tasks.inference.score.s3_table import score_to_object_store

        return score_to_object_store(scoring, run_shards)
    model, images, dest = scoring.model, scoring.images, Path(scoring.dest)
    check_name_length(dest, "scored table")  # before the checkpoint folder is made beside it
    refs, labeled = list_images(images)
    total = len(refs)
    count = max(1, -(-total // scoring.shard_images))
    kwargs = {"batch_size": scoring.batch_size, "quantized": scoring.quantized}
    remove_leftovers(dest, SCRATCH)  # a killed run's private shards: they are never resumed
    if count == 1:
        del refs  # score lists them itself
        run_shards([ShardJob(model, images, dest, None, threads=scoring.threads, **kwargs)])
        return dest
    log = step_logger(LOGGER)
    folder = checkpoint_dir(model, refs, labeled, dest, shard_images=scoring.shard_images, **kwargs)
    del refs  # each shard lists the images again: two listings at once would double the memory
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
        run_shards(
            [
                ShardJob(model, images, parts[i], (i, count), threads=scoring.threads, **kwargs)
                for i in missing
            ]
        )
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


def score_in_shards(
    model: Path,
    images: Path | S3Url,
    dest: Path | S3Url,
    *,
    shard_images: int = SHARD_IMAGES,
    batch_size: int = 64,
    threads: int | None = None,
    quantized: bool = False,
) -> Path | S3Url:
    """:func:`score_sharded` with the shards scored one after another, in this process.

    The plain step (the CLI, DVC stages, tests); a flow scores the shards side by side as Prefect
    tasks with ``flows.score.score_in_flow``.
    """
    scoring = ShardedScoring(model, images, dest, shard_images, batch_size, threads, quantized)
    return score_sharded(scoring)
