"""The ImageDirectory contract every step reads and writes.

Labeled: torchvision's ImageFolder layout (``<root>/<class>/<image>``) plus
``<root>/manifest.json``. Unlabeled (for scoring): images anywhere below ``<root>`` and a manifest
without classes. The manifest is the source of truth for class ids (list index = id, classes sorted
by name, exactly as ImageFolder sorts them) and for which files belong to the set.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import Literal

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from models.atomic import write_json
from tasks.errors import InvalidDatasetError, InvalidImageDirectoryError, NotLabeledDatasetError

MANIFEST = "manifest.json"
FORMAT = "imageops.ImageDirectory"
FORMAT_VERSION = 1
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# Pillow format names we open; anything else is refused even if the extension looks right.
PIL_FORMATS = ("JPEG", "PNG", "PPM", "BMP", "TIFF", "WEBP")


class SkipReason(StrEnum):
    """Why a file was left out: the first word of every ``SkippedFile.reason``.

    A reason reads ``"<SkipReason>: <detail>"``, so tools can group skipped files by the code and
    people can read the detail.
    """

    EMPTY_FILE = "EmptyFile"
    NOT_AN_IMAGE = "NotAnImage"
    EXTENSION_MISMATCH = "ExtensionMismatch"
    UNREADABLE_IMAGE = "UnreadableImage"
    IMAGE_EXCEEDS_LIMIT = "ImageExceedsLimit"
    HIDDEN_FILE = "HiddenFile"
    BAD_FILE_NAME = "BadFileName"
    NOT_IN_CLASS_FOLDER = "NotInClassFolder"
    EMPTY_CLASS = "EmptyClass"
    SYMLINKED_FOLDER = "SymlinkedFolder"
    UNSAFE_ARCHIVE_MEMBER = "UnsafeArchiveMember"
    UNREADABLE_ARCHIVE_MEMBER = "UnreadableArchiveMember"

    def because(self, detail: str) -> str:
        """The reason text: code first, then what exactly was wrong."""
        return f"{self.value}: {detail}"


class ImageEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="POSIX path relative to the ImageDirectory root.")
    label: int | None = Field(description="Class id (index into `classes`); None when unlabeled.")
    sha256: str
    width: int
    height: int


class SkippedFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    reason: str


class Manifest(BaseModel):
    """``manifest.json``: what is in the directory, where it came from, what was left out."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["imageops.ImageDirectory"] = FORMAT
    format_version: int = FORMAT_VERSION
    labeled: bool
    classes: list[str] = Field(default_factory=list)
    counts: dict[str, int] = Field(default_factory=dict)
    images: list[ImageEntry]
    source: str = ""
    skipped: list[SkippedFile] = Field(default_factory=list)
    duplicates: list[list[str]] = Field(
        default_factory=list,
        description="Groups of image paths with the same sha256 (kept, but listed: duplicates "
        "inflate a class and leak between a training and a validation split).",
    )

    def labels(self) -> list[int]:
        return [int(e.label) for e in self.images if e.label is not None]


def is_image_file(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS


def find_duplicates(entries: Iterable[ImageEntry]) -> list[list[str]]:
    """Paths that share a sha256, as sorted groups of two or more, ordered by first path."""
    by_hash: dict[str, list[str]] = {}
    for entry in entries:
        by_hash.setdefault(entry.sha256, []).append(entry.path)
    return sorted(sorted(paths) for paths in by_hash.values() if len(paths) > 1)


def read_manifest(root: Path) -> Manifest:
    """Read and check ``<root>/manifest.json``; raise InvalidImageDirectoryError if unusable."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise InvalidImageDirectoryError(
            f"{root} is not an ImageDirectory: {MANIFEST} is missing.",
            "Create one with `imageops convert SOURCE DEST`.",
        )
    try:
        manifest = Manifest.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise InvalidImageDirectoryError(
            f"{path} is not a valid ImageDirectory manifest: {exc.errors()[0]['msg']}.",
            "Re-create the directory with `imageops convert`.",
        ) from exc
    if manifest.format_version > FORMAT_VERSION:
        raise InvalidImageDirectoryError(
            f"{path} has format version {manifest.format_version}; this imageops reads up to "
            f"{FORMAT_VERSION}.",
            "Upgrade imageops.",
        )
    return manifest


def write_manifest(root: Path, manifest: Manifest) -> Path:
    return write_json(Path(root) / MANIFEST, manifest.model_dump(mode="json"))


def require_labeled(manifest: Manifest, role: str, root: Path | str = "") -> None:
    """Seed rule: training needs a labeled image directory."""
    if not manifest.labeled or not manifest.classes:
        raise NotLabeledDatasetError(
            f"The {role} dataset {root} is not labeled (no class sub-folders).",
            "Convert a folder whose images sit in one sub-folder per class, or a labeled archive.",
        )


def require_same_classes(train: Manifest, val: Manifest) -> None:
    """Seed rule: training and validation data must have the same label categories."""
    if train.classes != val.classes:
        only_train = sorted(set(train.classes) - set(val.classes))
        only_val = sorted(set(val.classes) - set(train.classes))
        raise InvalidDatasetError(
            "Training and validation datasets have different classes "
            f"(only in training: {only_train or 'none'}; "
            f"only in validation: {only_val or 'none'}).",
            "Split one ImageDirectory with `imageops split` so both halves share the classes.",
        )


def load_rgb(path: Path) -> Image.Image:
    """Open an image as 8-bit RGB, whatever its mode (gray, palette, RGBA, CMYK, 16-bit).

    Decompression-bomb warnings become errors: an image that large is refused, not decoded.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with Image.open(path, formats=PIL_FORMATS) as img:
            img.load()
            return to_rgb(img)


def to_rgb(img: Image.Image) -> Image.Image:
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        # 16/32-bit integer gray: scale to 8 bits instead of letting convert() clip at 255.
        import numpy as np

        arr = np.asarray(img, dtype=np.float64)
        top = 65535.0 if img.mode.startswith("I;16") else max(float(arr.max()), 1.0)
        img = Image.fromarray((arr * (255.0 / top)).clip(0, 255).astype("uint8"), mode="L")
    elif img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA"):
        background = Image.new("RGB", img.size, (255, 255, 255))
        background.paste(img, mask=img.getchannel("A"))
        return background
    return img.convert("RGB")
