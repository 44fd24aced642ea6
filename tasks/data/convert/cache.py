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
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from tasks.data.convert.checking import available_cores, ordered_map
from tasks.data.convert.plan import ConversionPlan, PlannedFile
from tasks.data.imagecheck import file_fingerprint
from tasks.data.imagedir import MANIFEST, recorded_source
from tasks.data.manifest_stream import StreamedManifest, iter_images, read_head
from tasks.shared.errors import ImageOpsError
from tasks.shared.file_hash import file_sha256

log = logging.getLogger("tasks.data.convert")

# Files per task when hashing for the cache check; one chunk or less is hashed in this thread.
_HASH_CHUNK = 64


class Fingerprint:
    """sha256 over ``head`` (parameters, versions) and what the source holds, made as the files
    are read, in any order.

    With a ``plan``: the layout, what was skipped before reading, and per file (:meth:`add`,
    by its place in the plan) its path, destination, label, size and sha256 (``(-1, "")`` when
    unreadable), each kept as 32 bytes and hashed in the plan's order at the end.
    """

    def __init__(self, head: dict[str, Any], plan: ConversionPlan | None = None) -> None:
        self._digest = hashlib.sha256(json.dumps(head, sort_keys=True).encode())
        self._files = bytearray(0 if plan is None else 32 * len(plan.items))
        if plan is not None:
            skipped = [[s.path, s.reason] for s in plan.skipped]
            self._digest.update(json.dumps([plan.labeled, plan.classes, skipped]).encode())

    def add(self, index: int, item: PlannedFile, size: int, sha256: str) -> None:
        record = json.dumps([item.rel, item.dest, item.label, size, sha256]).encode()
        self._files[32 * index : 32 * index + 32] = hashlib.sha256(record).digest()

    def hexdigest(self) -> str:
        digest = self._digest.copy()
        digest.update(self._files)
        return digest.hexdigest()


def fingerprint(
    head: dict[str, Any],
    plan: ConversionPlan | None = None,
    digests: Iterable[tuple[int, str]] = (),
) -> str:
    """The :class:`Fingerprint` of ``head``, and of ``plan`` with each file's ``digests``."""
    made = Fingerprint(head, plan)
    if plan is not None:
        for index, (item, (size, sha256)) in enumerate(zip(plan.items, digests, strict=True)):
            made.add(index, item, size, sha256)
    return made.hexdigest()


def sha256_file(path: str | Path) -> tuple[int, str]:
    """``(size, sha256)``, or ``(-1, "")`` for a file that cannot be read."""
    try:
        return file_sha256(path)
    except OSError:
        return -1, ""


def hash_all(items: Sequence[PlannedFile], max_pixels: int) -> Iterator[tuple[int, str]]:
    """(size, sha256) of each file, in order, as :func:`tasks.data.imagecheck.check_file` reports
    them (a file it would not read, by its extension or size, is not read here either).

    Threads, not processes: reading and hashing release the GIL, and a thread starts at once.
    From the page cache one thread is as fast; the others help when the disk makes us wait.
    A window of chunks at a time: the hashes of a million files are never all in memory.
    """
    if len(items) <= _HASH_CHUNK:
        yield from _hash_chunk([(item.source, item.rel) for item in items], max_pixels)
        return
    chunks = (
        [(item.source, item.rel) for item in items[i : i + _HASH_CHUNK]]
        for i in range(0, len(items), _HASH_CHUNK)
    )
    threads = min(8, 2 * available_cores())
    with ThreadPoolExecutor(max_workers=threads) as pool:
        hash_chunk = partial(_hash_chunk, max_pixels=max_pixels)
        for hashed in ordered_map(pool, hash_chunk, chunks, ahead=4 * threads):
            yield from hashed


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
        if head.fingerprint is None or head.source != recorded_source(source):
            return None
        count = _intact(dest)
    except (ImageOpsError, OSError):
        return None  # not a directory we can trust: convert again, replacing it
    if count is None:
        return None
    return StreamedManifest.of(head, dest, count)


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
