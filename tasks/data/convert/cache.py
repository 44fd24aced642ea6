"""Convert's cache: converting again is a hit when nothing changed.

The manifest keeps a fingerprint of what was read (the bytes, never the timestamps, so the same
images give the same directory and the same DVC version wherever they are converted) and of the
parameters. When ``dest`` holds a manifest with the fingerprint the source has now, and every file
it lists is there with its size, that manifest is returned: nothing is decoded or written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from tasks.data.convert.checking import available_cores
from tasks.data.convert.plan import ConversionPlan, PlannedFile
from tasks.data.imagecheck import file_fingerprint
from tasks.data.imagedir import MANIFEST
from tasks.data.manifest_stream import StreamedManifest, iter_images, read_head
from tasks.shared.errors import ImageOpsError
from tasks.shared.file_hash import file_sha256

log = logging.getLogger("tasks.data.convert")

# Files per task when hashing for the cache check; one chunk or less is hashed in this thread.
_HASH_CHUNK = 64


def fingerprint(
    head: dict[str, Any],
    plan: ConversionPlan | None = None,
    digests: Sequence[tuple[int, str]] = (),
) -> str:
    """sha256 over ``head`` (parameters, versions) and what the source holds.

    With a ``plan``: the layout, what was skipped before reading, and per file its path,
    destination, label, size and sha256 (``(-1, "")`` when unreadable), from ``digests``.
    """
    digest = hashlib.sha256(json.dumps(head, sort_keys=True).encode())
    if plan is not None:
        skipped = [[s.path, s.reason] for s in plan.skipped]
        digest.update(json.dumps([plan.labeled, plan.classes, skipped]).encode())
        for item, (size, sha256) in zip(plan.items, digests, strict=True):
            digest.update(json.dumps([item.rel, item.dest, item.label, size, sha256]).encode())
    return digest.hexdigest()


def sha256_file(path: str | Path) -> tuple[int, str]:
    """``(size, sha256)``, or ``(-1, "")`` for a file that cannot be read."""
    try:
        return file_sha256(path)
    except OSError:
        return -1, ""


def hash_all(items: Sequence[PlannedFile], max_pixels: int) -> list[tuple[int, str]]:
    """(size, sha256) of each file, as :func:`tasks.data.imagecheck.check_file` reports them (a file
    it would not read, by its extension or size, is not read here either).

    Threads, not processes: reading and hashing release the GIL, and a thread starts at once.
    From the page cache one thread is as fast; the others help when the disk makes us wait.
    """
    files = [(item.source, item.rel) for item in items]
    chunks = [files[i : i + _HASH_CHUNK] for i in range(0, len(files), _HASH_CHUNK)]
    if len(chunks) <= 1:
        return _hash_chunk(files, max_pixels)
    with ThreadPoolExecutor(max_workers=min(8, 2 * available_cores())) as pool:
        hashed = pool.map(partial(_hash_chunk, max_pixels=max_pixels), chunks)
        return [d for chunk in hashed for d in chunk]


def _hash_chunk(files: Sequence[tuple[str, str]], max_pixels: int) -> list[tuple[int, str]]:
    return [file_fingerprint(source, rel, max_pixels) for source, rel in files]


def previous(dest: Path, source: Path) -> StreamedManifest | None:
    """The manifest in ``dest`` when it may be a cache hit, else None.

    That is: converted from ``source``, with a fingerprint, and every file it lists still there
    with its size (and nothing else).
    """
    if not (dest / MANIFEST).is_file():
        return None
    try:
        head = read_head(dest)
        if head.fingerprint is None or head.source != str(source.resolve()):
            return None
        count = _intact(dest)
    except (ImageOpsError, OSError):
        return None  # not a directory we can trust: convert again, replacing it
    if count is None:
        return None
    return StreamedManifest(**head.model_dump(), root=dest, image_count=count)


def _intact(dest: Path) -> int | None:
    """How many images ``dest`` holds when every listed file is a regular file of the recorded
    size and no other file is there; None otherwise.

    Sizes, not hashes: this check is a stat per file. A file changed in place with its size
    kept goes unnoticed, as it does for DVC's own status.
    """
    expected: dict[str, int] = {}
    for entry in iter_images(dest):
        if entry.size is None:
            return None  # written before sizes were recorded
        expected[entry.path] = entry.size
    count = len(expected)
    for folder, _dirnames, filenames in os.walk(dest):
        for name in filenames:
            path = os.path.join(folder, name)
            try:
                info = os.lstat(path)
            except OSError:  # gone while we looked: not intact
                return None
            if not stat.S_ISREG(info.st_mode):
                return None
            rel = Path(path).relative_to(dest).as_posix()
            if rel == MANIFEST:
                continue
            if expected.pop(rel, None) != info.st_size:
                return None
    return None if expected else count


def unchanged(dest: Path, manifest: StreamedManifest) -> StreamedManifest:
    log.info(
        "%s is up to date: the source and parameters have not changed since it was converted "
        "(%d images); nothing to do.",
        dest,
        manifest.image_count,
    )
    return manifest
