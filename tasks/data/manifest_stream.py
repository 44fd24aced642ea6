"""``manifest.json`` read and written one image at a time, so memory does not grow with the images.

The file stays one JSON document (any JSON reader, ``jq`` or ``pandas.json_normalize`` reads it),
laid out for streaming: the head (every key but ``images``) indented, then the image list last,
one line per image. A reader stops at the list for the head (:func:`read_head`) and parses it
line by line for the images (:func:`iter_images`); a writer (:class:`ManifestWriter`) keeps the
lines in an unnamed scratch file until the head is known. A manifest in another layout (the list
in the middle, written before; indented entries, older still; or edited by hand) is read whole,
as it always was. Details: docs/images.md#manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from array import array
from collections import Counter
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import IO

import numpy as np
from pydantic import Field, PrivateAttr, ValidationError

from models.atomic import atomic_file
from tasks.data.imagedir import (
    MANIFEST,
    ImageEntry,
    Manifest,
    ManifestHead,
    PathCheck,
    check_format_version,
    invalid_manifest,
    missing_manifest,
)
from tasks.shared.errors import InvalidImageDirectoryError

_OPEN = b'  "images": [\n'  # a top-level key is the only line at this indent that starts so
_CLOSE = (b"  ]\n", b"  ],\n")
_LAST = b"\n  ]\n}\n"  # how a file whose list comes last ends
_TAIL_BYTES = 64 * 1024  # enough for the last entry's line (a path is at most 4,096 bytes)


class StreamedManifest(ManifestHead):
    """What a step that streams its images returns: the head, the count, and the images read
    back from ``root`` when asked for (a person's small data set, a test).

    The images are those of the manifest the step wrote: asked for after that file was written
    again (a second conversion into the same folder), they are an error, not the new ones.
    """

    root: Path = Field(exclude=True)
    image_count: int = Field(exclude=True)
    _stamp: tuple[int, int, int] | None = PrivateAttr(default=None)

    def model_post_init(self, context: object, /) -> None:
        self._stamp = _stamp(self.root / MANIFEST)

    @cached_property
    def images(self) -> list[ImageEntry]:
        if _stamp(self.root / MANIFEST) != self._stamp:
            raise InvalidImageDirectoryError(
                f"{self.root / MANIFEST} was written again after this result was returned: "
                "its images are not this result's any more.",
                "Read the directory as it is now with read_manifest.",
            )
        return list(iter_images(self.root))

    @classmethod
    def of(cls, head: ManifestHead, root: Path, image_count: int) -> StreamedManifest:
        """The result for ``root``'s manifest, whose head (from :func:`read_head`) and count
        are known."""
        return cls(**head.model_dump(), root=root, image_count=image_count)

    def whole(self) -> Manifest:
        """The manifest as :func:`tasks.data.imagedir.read_manifest` reads it."""
        return Manifest(**self.model_dump(), images=self.images)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StreamedManifest):
            return NotImplemented
        return self.model_dump() == other.model_dump() and self.images == other.images

    __hash__ = None  # type: ignore[assignment]


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """Which file ``path`` is: a rewrite (a new file renamed over it) changes the inode."""
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_ino, info.st_mtime_ns, info.st_size


def _is_entry_line(line: bytes) -> bool:
    return line.startswith(b"    {") and line.endswith((b"}\n", b"},\n"))


def _whole(path: Path) -> Manifest:
    """The manifest parsed in one piece (any layout): memory grows with its images."""
    try:
        return Manifest.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise invalid_manifest(path, exc.errors()[0]["msg"]) from exc


def _find_list(fh: IO[bytes]) -> tuple[bytes, bool]:
    """Read up to the image list's first line: (what came before it, whether the list is there
    in the streaming layout). The file is left at the list's first entry."""
    before = bytearray()
    for line in fh:
        if line == _OPEN:
            start = fh.tell()
            streamable = _is_entry_line(fh.readline())
            fh.seek(start)
            return bytes(before), streamable
        before += line
    return bytes(before), False


def _list_is_last(fh: IO[bytes]) -> bool:
    """Whether the file ends with the image list (an entry's line, then ``]`` and ``}``)."""
    size = os.fstat(fh.fileno()).st_size
    fh.seek(max(0, size - _TAIL_BYTES))
    tail = fh.read()
    if not tail.endswith(_LAST):
        return False
    last = tail[: -len(_LAST)].rpartition(b"\n")[2] + b"\n"
    return _is_entry_line(last)


def read_head(root: Path) -> ManifestHead:
    """Everything ``<root>/manifest.json`` says but its image list, without reading the list
    when it is last (the layout written now). Raises InvalidImageDirectoryError."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise missing_manifest(root)
    with path.open("rb") as fh:
        before, streamable = _find_list(fh)
        if not streamable:
            head = _whole(path).head()
            check_format_version(path, head.format_version)
            return head
        if _list_is_last(fh):
            after = b"}\n"
        else:  # the list in the middle (written before): read past it for the keys after it
            fh.seek(len(before) + len(_OPEN))
            for line in fh:
                if line in _CLOSE:
                    break
            after = fh.read()
    text = before.rstrip().rstrip(b",") + b"\n" if after.startswith(b"}") else before
    try:
        head = ManifestHead.model_validate_json(text + after)
    except ValidationError as exc:
        raise invalid_manifest(path, exc.errors()[0]["msg"]) from exc
    check_format_version(path, head.format_version)
    return head


def iter_images(root: Path) -> Iterator[ImageEntry]:
    """The images ``<root>/manifest.json`` lists, in its order, one line read at a time.

    Each path is checked as :func:`tasks.data.imagedir.read_manifest` checks them (inside the
    directory). A list that leaves the one-line layout part way (edited by hand) is read whole
    from there on. Raises InvalidImageDirectoryError.
    """
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise missing_manifest(root)
    check = PathCheck(root)
    with path.open("rb") as fh:
        _, streamable = _find_list(fh)
        done = 0
        if streamable:
            for number, line in enumerate(fh, start=1):
                if line in _CLOSE:
                    return
                if not _is_entry_line(line):
                    break
                try:
                    entry = ImageEntry.model_validate_json(line.rstrip(b",\n"))
                except ValidationError as exc:
                    what = f"image {number} of its list: {exc.errors()[0]['msg']}"
                    raise invalid_manifest(path, what) from exc
                check(entry.path)
                yield entry
                done += 1
    for entry in _whole(path).images[done:]:
        check(entry.path)
        yield entry


def count_images(root: Path) -> int:
    """How many images ``<root>/manifest.json`` lists (a line count in the streaming layout)."""
    path = Path(root) / MANIFEST
    with path.open("rb") as fh:
        _, streamable = _find_list(fh)
        if not streamable:
            return len(_whole(path).images)
        for count, line in enumerate(fh):
            if line in _CLOSE:
                return count
            if not _is_entry_line(line):
                break  # the layout ends part way (edited by hand): count the whole list
    return len(_whole(path).images)


class ManifestWriter:
    """Writes ``<root>/manifest.json`` one image at a time, atomically.

    The image lines wait in unnamed scratch files (nothing is left behind by a crash), one per
    ``part``: the list is part 0's lines in the order added, then part 1's, and so on (convert
    checks the two halves of a big input side by side). Meanwhile the writer counts the images
    per class and keeps 8 bytes of each sha256 to find duplicates; :meth:`finish` writes the
    head, with those counts and duplicate groups, and the lines after it. Use it as a context
    manager: the scratch files are closed however the block ends. ``dest``: where ``root`` will
    be once written (an atomic directory's final name), for the result.
    """

    def __init__(self, root: Path, dest: Path | None = None, parts: int = 1) -> None:
        self.root = Path(root)
        self.dest = self.root if dest is None else Path(dest)  # where root ends up
        self._parts = [self._scratch() for _ in range(parts)]
        self._sizes = [0] * parts
        self._labels: Counter[int | None] = Counter()
        self._prefixes = array("Q")
        self.count = 0

    def _scratch(self) -> IO[bytes]:
        # Closed by finish() or on leaving the ``with`` block; unnamed, so never left behind.
        return tempfile.TemporaryFile(dir=self.root)

    def __enter__(self) -> ManifestWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        for part in self._parts:
            part.close()

    def add(self, entry: ImageEntry, part: int = 0) -> None:
        # Without the optional fields at their defaults ("source_path": null on nearly every
        # line): they read back the same. Each line of a part but its first starts with the
        # comma that ends the one before.
        line = entry.model_dump_json(exclude_defaults=True).encode()
        self._parts[part].write((b",\n    " if self._sizes[part] else b"    ") + line)
        self._sizes[part] += 1
        self._labels[entry.label] += 1
        self._prefixes.append(int(entry.sha256[:16], 16))
        self.count += 1

    def classes_used(self, classes: int) -> list[bool]:
        """Whether each of the class ids ``0 .. classes - 1`` has an image so far."""
        return [self._labels.get(i, 0) > 0 for i in range(classes)]

    def _entries(self, part: IO[bytes]) -> Iterator[ImageEntry]:
        part.seek(0)
        for line in part:
            yield ImageEntry.model_validate_json(line.strip().rstrip(b","))

    def relabel(self, ids: dict[int, int]) -> None:
        """Give every image added so far the class id ``ids[label]`` (a class left out shifts
        the ids after it): the lines are rewritten once, through new scratch files."""
        old, self._parts = self._parts, [self._scratch() for _ in self._parts]
        self._sizes, self.count, self._labels = [0] * len(old), 0, Counter()
        self._prefixes = array("Q")
        for index, part in enumerate(old):
            with part:
                for entry in self._entries(part):
                    if entry.label is not None:
                        entry.label = ids[entry.label]
                    self.add(entry, index)

    def _duplicates(self) -> list[list[str]]:
        """Groups of paths with one sha256: candidates by prefix, confirmed on a second pass."""
        prefixes = np.frombuffer(self._prefixes, dtype=np.uint64)
        values, counts = np.unique(prefixes, return_counts=True)
        shared = {int(v) for v in values[counts > 1]}
        if not shared:
            return []
        by_hash: dict[str, list[str]] = {}
        for part in self._parts:
            for entry in self._entries(part):
                if int(entry.sha256[:16], 16) in shared:
                    by_hash.setdefault(entry.sha256, []).append(entry.path)
        return sorted(sorted(paths) for paths in by_hash.values() if len(paths) > 1)

    def finish(self, head: ManifestHead) -> StreamedManifest:
        """Write the manifest: ``head`` with the counts and duplicates of the images added."""
        counts = {c: self._labels.get(i, 0) for i, c in enumerate(head.classes)}
        fields = head.model_dump() | {"counts": counts, "duplicates": self._duplicates()}
        text = ManifestHead.model_validate(fields).model_dump_json(indent=2)
        head_bytes = text.removesuffix("\n}").encode() + b",\n"  # the keys, the list to come
        with atomic_file(self.root / MANIFEST) as tmp, open(tmp, "wb") as out:
            if self.count:
                out.write(head_bytes + _OPEN)
                written = 0
                for part, size in zip(self._parts, self._sizes, strict=True):
                    if size:
                        out.write(b",\n" if written else b"")
                        part.seek(0)
                        shutil.copyfileobj(part, out)
                        written += size
                out.write(_LAST)
            else:
                out.write(head_bytes + b'  "images": []\n}\n')
            out.flush()
            os.fsync(out.fileno())
        for part in self._parts:
            part.close()
        result = StreamedManifest(**fields, root=self.dest, image_count=self.count)
        result._stamp = _stamp(self.root / MANIFEST)  # the file as written: moved, not copied
        return result


def content_digest(root: Path, head: ManifestHead | None = None) -> str | None:
    """sha256 of what a model is scored on here: each image's path, label and content (the
    manifest's sha256), the classes and the applied transform; None when the folder no longer
    matches its manifest.

    The same on every machine and wherever the folder sits (the manifest is read, no image is),
    and one image replaced or relabeled changes it. Names, sources and skipped files are left
    out: they change no score. A file whose size differs from the manifest's has been edited
    in place; the manifest then no longer says what the folder holds, so there is no identity.
    Streamed: the bytes hashed are those of ``json.dumps(content, sort_keys=True)`` of the whole
    record, as digests recorded before were made.
    """
    root = Path(root)
    head = head or read_head(root)
    transform = None if head.transform is None else head.transform.model_dump(mode="json")
    digest = hashlib.sha256()
    digest.update(
        f'{{"classes": {json.dumps(head.classes)}, '
        f'"format_version": {json.dumps(head.format_version)}, "images": ['.encode()
    )
    separator = ""
    for entry in iter_images(root):
        if entry.size is not None:
            try:
                if os.stat(root / entry.path).st_size != entry.size:
                    return None
            except OSError:
                return None
        digest.update((separator + json.dumps([entry.path, entry.label, entry.sha256])).encode())
        separator = ", "
    digest.update(
        f'], "labeled": {json.dumps(head.labeled)}, '
        f'"transform": {json.dumps(transform, sort_keys=True)}}}'.encode()
    )
    return digest.hexdigest()
