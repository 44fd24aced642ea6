"""The images a scoring reads: which files, in what order, under which names, with which class.

An ImageDirectory is read from its manifest; any other folder is walked. Each image becomes an
:class:`ImageRef`; one the table cannot name (not UTF-8) carries its problem and is scored as an
error row, so the listing never fails on one file. An ``s3://`` prefix is listed by the same rules
(:mod:`tasks.inference.score.s3_images`).
"""

from __future__ import annotations

import io
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.data.imagedir import (
    MANIFEST,
    SkipReason,
    is_image_file,
    is_utf8,
    printable_name,
)
from tasks.data.manifest_stream import count_images, iter_images, read_head
from tasks.shared.errors import NoUsableImagesError
from tasks.shared.object_store import S3Url

if TYPE_CHECKING:
    from models.transform_spec import AppliedTransform


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image to score: where it is, how the table names it, its true class if known.

    Small (about 150 bytes with its name): a scoring lists every image before it reads one,
    so the root is shared and the file's path is made when it is opened.
    """

    root: Path | S3Url  # a folder, or a prefix in S3
    path: str
    category: str | None
    problem: str = ""  # why it is not scored, found before reading it (an error row)
    rel: str | None = None  # the file below root, where it is not ``path`` (an odd name)
    stamp: str | None = None  # an S3 object's size and ETag as listed: what a checkpoint sees

    @property
    def file(self) -> Path | S3Url:
        return self.root / (self.path if self.rel is None else self.rel)

    def source(self) -> Path | io.BytesIO:
        """What the decoder reads: the file, or the S3 object's bytes, fetched now (never kept
        on disk)."""
        if isinstance(self.root, Path):
            return self.file
        from tasks.inference.score.s3_images import read_object

        return read_object(self.root / self.path)


def list_images(images: Path | S3Url) -> tuple[list[ImageRef], bool]:
    """The images to score, in a stable order, and whether they are labeled.

    An ImageDirectory is read from its manifest (labeled ones carry the true class); any other
    folder is walked recursively for image extensions, hidden files left out, and is unlabeled.
    """
    refs, labeled, _, _ = list_slice(images, lambda total: (0, total))
    return refs, labeled


def list_slice(
    images: Path | S3Url, bounds: Callable[[int], tuple[int, int]]
) -> tuple[list[ImageRef], bool, int, int]:
    """One slice of :func:`list_images`: ``bounds(total)`` gives its ``[first, last)``.

    Returns the slice's images, whether the input is labeled, ``first`` and the total. Of an
    ImageDirectory only the slice is kept (a shard of a big input holds its own images, not
    the listing of all of them).
    """
    if isinstance(images, S3Url):
        from tasks.inference.score.s3_images import list_s3_slice

        return list_s3_slice(images, bounds)
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


def image_order(rel: str) -> list[str]:
    """The sort key of a path below the input: part by part, as a folder walk meets them."""
    return rel.split("/")


def applied_transform(images: Path | S3Url) -> AppliedTransform | None:
    """What Apply Image Transformation did to the input (None: raw images), here or in S3."""
    if isinstance(images, S3Url):
        from tasks.inference.score.s3_images import s3_applied_to

        return s3_applied_to(images)
    from tasks.data.transform import applied_to

    return applied_to(images)


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
    found.sort(key=image_order)
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
