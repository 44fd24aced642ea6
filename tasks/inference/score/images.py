"""The images a scoring reads: which files, in what order, under which names, with which class.

An ImageDirectory is read from its manifest; any other folder is walked. Each image becomes an
:class:`ImageRef`; one the table cannot name (not UTF-8) carries its problem and is scored as an
error row, so the listing never fails on one file.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tasks.data.imagedir import (
    MANIFEST,
    SkipReason,
    is_image_file,
    is_utf8,
    printable_name,
)
from tasks.data.manifest_stream import count_images, iter_images, read_head
from tasks.shared.errors import NoUsableImagesError


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image to score: where it is, how the table names it, its true class if known.

    Small (about 150 bytes with its name): a scoring lists every image before it reads one,
    so the root is shared and the file's path is made when it is opened.
    """

    root: Path
    path: str
    category: str | None
    problem: str = ""  # why it is not scored, found before reading it (an error row)
    rel: str | None = None  # the file below root, where it is not ``path`` (an odd name)

    @property
    def file(self) -> Path:
        return self.root / (self.path if self.rel is None else self.rel)


def list_images(images: Path) -> tuple[list[ImageRef], bool]:
    """The images to score, in a stable order, and whether they are labeled.

    An ImageDirectory is read from its manifest (labeled ones carry the true class); any other
    folder is walked recursively for image extensions, hidden files left out, and is unlabeled.
    """
    refs, labeled, _, _ = list_slice(images, lambda total: (0, total))
    return refs, labeled


def list_slice(
    images: Path, bounds: Callable[[int], tuple[int, int]]
) -> tuple[list[ImageRef], bool, int, int]:
    """One slice of :func:`list_images`: ``bounds(total)`` gives its ``[first, last)``.

    Returns the slice's images, whether the input is labeled, ``first`` and the total. Of an
    ImageDirectory only the slice is kept (a shard of a big input holds its own images, not
    the listing of all of them).
    """
    images = Path(images)
    if not images.is_dir():
        raise NoUsableImagesError(
            f"{images} is not a folder.", "Pass an ImageDirectory or a folder of images."
        )
    if not (images / MANIFEST).is_file():
        found = _walk(images)
        first, last = bounds(len(found))
        return [_raw_ref(images, rel) for rel in found[first:last]], False, first, len(found)
    head = read_head(images)
    total = count_images(images)
    first, last = bounds(total)
    classes: list[str | None] = list(head.classes) if head.labeled else []
    refs = [
        ImageRef(images, entry.path, classes[entry.label] if classes else None)
        for entry in itertools.islice(iter_images(images), first, last)
    ]
    return refs, head.labeled, first, total


def _walk(images: Path) -> list[str]:
    """The image files below ``images`` (hidden ones left out), as paths sort: part by part."""
    found: list[str] = []
    for folder, dirnames, filenames in os.walk(images):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        below = os.path.relpath(folder, images)
        prefix = "" if below == "." else below.replace(os.sep, "/") + "/"
        found += [
            prefix + name
            for name in filenames
            if not name.startswith(".")
            and is_image_file(Path(name))
            and os.path.isfile(os.path.join(folder, name))
        ]
    found.sort(key=lambda rel: rel.split("/"))
    return found


def _raw_ref(root: Path, rel: str) -> ImageRef:
    """A raw folder's image; one whose name is not UTF-8 (the table is UTF-8) becomes an error
    row under its name with the odd bytes as ``\\xNN``, so every other image is still scored."""
    if is_utf8(rel):
        return ImageRef(root, rel, None)
    reason = SkipReason.BAD_FILE_NAME.because(
        "the name is not UTF-8, so the table cannot hold it; rename the file"
    )
    return ImageRef(root, printable_name(rel), None, problem=reason, rel=rel)
