"""The images a scoring reads: which files, in what order, under which names, with which class.

An ImageDirectory is read from its manifest; any other folder is walked. Each image becomes an
:class:`ImageRef`; one the table cannot name (not UTF-8) carries its problem and is scored as an
error row, so the listing never fails on one file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.data.imagedir import (
    MANIFEST,
    SkipReason,
    is_image_file,
    is_utf8,
    printable_name,
    read_manifest,
)
from tasks.shared.errors import NoUsableImagesError


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
