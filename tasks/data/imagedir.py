"""The ImageDirectory contract every step reads and writes.

Labeled: torchvision's ImageFolder layout (``<root>/<class>/<image>``) plus
``<root>/manifest.json``. Unlabeled (for scoring): images anywhere below ``<root>`` and a manifest
without classes. The manifest is the source of truth for class ids (list index = id, classes sorted
by name, exactly as ImageFolder sorts them) and for which files belong to the set.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from models.atomic import write_text
from models.transform_spec import AppliedTransform

# Part of this contract, kept in a module without pydantic so that convert's worker processes
# start fast; import them from here.
from tasks.data.imageformat import (  # noqa: F401
    IMAGE_EXTENSIONS,
    MAX_ASPECT_RATIO,
    MAX_PIXELS,
    PIL_FORMATS,
    ImageRefused,
    SkipReason,
    is_image_file,
    is_utf8,
    load_rgb,
    printable_name,
    to_rgb,
)
from tasks.shared.errors import (
    InvalidDatasetError,
    InvalidImageDirectoryError,
    NotLabeledDatasetError,
)
from tasks.shared.settings import get_settings

MANIFEST = "manifest.json"
# A name the manifest reports (a skipped file, the source) rather than opens: one that is not
# UTF-8 is kept with \xNN escapes, since a manifest holding it would not read back.
ReportedName = Annotated[str, AfterValidator(printable_name)]
FORMAT = "imageops.ImageDirectory"
FORMAT_VERSION = 1


class ImageEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="POSIX path relative to the ImageDirectory root.")
    label: int | None = Field(description="Class id (index into `classes`); None when unlabeled.")
    sha256: str
    width: int
    height: int
    # Added after format version 1 shipped; optional, so older manifests still read.
    size: int | None = Field(default=None, description="Bytes (the copy is byte for byte).")
    source_path: str | None = Field(
        default=None,
        description="Where the image came from, relative to the CSV manifest's or COCO JSON's "
        "folder; None when it is `path` itself (folders and archives).",
    )


class SkippedFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: ReportedName
    reason: str


class ManifestHead(BaseModel):
    """``manifest.json`` without its image list: what a step needs before it reads the images.

    Read by :func:`tasks.data.manifest_stream.read_head` without reading the list, which
    :func:`tasks.data.manifest_stream.iter_images` streams, so memory does not grow with it.
    """

    model_config = ConfigDict(extra="forbid")

    format: Literal["imageops.ImageDirectory"] = FORMAT
    format_version: int = FORMAT_VERSION
    labeled: bool
    classes: list[str] = Field(default_factory=list)
    counts: dict[str, int] = Field(default_factory=dict)
    source: ReportedName = ""
    skipped: list[SkippedFile] = Field(default_factory=list)
    duplicates: list[list[str]] = Field(
        default_factory=list,
        description="Groups of image paths with the same sha256 (kept, but listed: duplicates "
        "inflate a class and leak between a training and a validation split).",
    )
    fingerprint: str | None = Field(
        default=None,
        description="What Convert read and how: sha256 over the source's content (never its "
        "timestamps) and the parameters. Converting the same source with the same fingerprint "
        "into a directory that is still intact returns this manifest without any work. Steps "
        "that derive a directory from another (split) leave it empty.",
    )
    transform: AppliedTransform | None = Field(
        default=None,
        description="Set by Apply Image Transformation (and kept by split): the transform spec "
        "and mode the images went through. Train and score use this spec and skip what was "
        "already applied.",
    )


class Manifest(ManifestHead):
    """``manifest.json`` whole: what is in the directory, where it came from, what was left out.

    The image list comes last in the file, one line per image, so the head reads without it.
    """

    images: list[ImageEntry]

    def head(self) -> ManifestHead:
        return ManifestHead.model_validate(self.model_dump(exclude={"images"}))


def recorded_source(source: Path) -> str:
    """How a manifest names the folder or file it was made from (its ``source``).

    From the project root when it is in the project (``data/raw/digits``), and as
    ``$IMAGEOPS_HOME/...`` when it is in imageops' home (a data version fetched from the DVC
    remote), so the same data prepared in two checkouts on two machines is the same bytes, and
    so the same DVC version; absolute elsewhere.
    """
    settings = get_settings()
    path = Path(source).resolve()
    root, home = settings.project_root.resolve(), settings.home_dir.resolve()
    if path.is_relative_to(home) and not home.is_relative_to(path):
        return f"$IMAGEOPS_HOME/{path.relative_to(home).as_posix()}"
    if path.is_relative_to(root):
        return path.relative_to(root).as_posix()
    return str(path)


def missing_manifest(root: Path) -> InvalidImageDirectoryError:
    return InvalidImageDirectoryError(
        f"{root} is not an ImageDirectory: {MANIFEST} is missing.",
        "Create one with `imageops convert SOURCE DEST`.",
    )


def invalid_manifest(path: Path, what: str) -> InvalidImageDirectoryError:
    return InvalidImageDirectoryError(
        f"{path} is not a valid ImageDirectory manifest: {what}.",
        "Re-create the directory with `imageops convert`.",
    )


def check_format_version(path: Path, version: int) -> None:
    """Refuse a manifest written by a newer imageops."""
    if version > FORMAT_VERSION:
        raise InvalidImageDirectoryError(
            f"{path} has format version {version}; this imageops reads up to {FORMAT_VERSION}.",
            "Upgrade imageops.",
        )


def read_manifest(root: Path) -> Manifest:
    """Read and check ``<root>/manifest.json``; raise InvalidImageDirectoryError if unusable."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise missing_manifest(root)
    try:
        manifest = Manifest.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise invalid_manifest(path, exc.errors()[0]["msg"]) from exc
    check_format_version(path, manifest.format_version)
    check = PathCheck(root)
    for entry in manifest.images:
        check(entry.path)
    return manifest


_DRIVE = re.compile(r"^[A-Za-z]:")


class PathCheck:
    """Every image path stays inside ``root``, as Convert keeps archive members inside theirs.

    A manifest is a file anyone can edit: an entry ``../../x.png`` or ``/etc/x.png``, or one that
    reaches a symlink leading out of the directory, would make a step read (and split write)
    outside the folders it was given. Checked by shape first (relative POSIX, no ``..``, no NUL;
    a backslash counts as a separator here, as Windows would take it), then by where the path
    resolves: one realpath per folder, one lstat per file. Call it on each path as it is read.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._base = os.path.realpath(root)
        self._folders: dict[str, str | None] = {}  # folder -> where it resolves, None: outside

    def _inside(self, real: str) -> bool:
        return os.path.commonpath([self._base, real]) == self._base

    def __call__(self, name: str) -> None:
        problem = manifest_path_problem(name)
        if problem is None:
            folder, _, leaf = name.rpartition("/")
            if folder not in self._folders:
                real_folder = os.path.realpath(os.path.join(self._base, folder))
                self._folders[folder] = real_folder if self._inside(real_folder) else None
            # A leaf has no "/" and is not "..": only a symlink can take it out of its folder.
            where = self._folders[folder]
            real = None if where is None else os.path.join(where, leaf)
            if real is None or (os.path.islink(real) and not self._inside(os.path.realpath(real))):
                problem = "it leads outside the directory through a symlink"
        if problem is not None:
            raise InvalidImageDirectoryError(
                f"{self.root / MANIFEST} lists the image {name!r}: {problem}; every image path "
                "must be relative to the ImageDirectory and stay inside it.",
                "Do not edit manifest.json by hand: re-create the directory with "
                "`imageops convert SOURCE DEST` (a symlink out is refused; copy the file in).",
            )


def manifest_path_problem(name: str) -> str | None:
    """What is wrong with the form of the manifest path ``name``; None when it is sound.

    Convert asks too, so it never writes a directory its own readers refuse (a class folder
    named ``C:`` reads as a Windows drive).
    """
    if "\x00" in name:
        return "a NUL byte in the path"
    if not name:
        return "an empty path"
    if name.startswith(("/", "\\")) or _DRIVE.match(name):
        return "an absolute path"
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        return "'..' in the path"
    if any(part in ("", ".") for part in name.split("/")):
        return "not a normalised POSIX path (empty or '.' parts)"
    return None


def write_manifest(root: Path, manifest: Manifest) -> Path:
    """``<root>/manifest.json``, atomically: indented JSON, the image list last, one line per image.

    One line per image, not the eight of a fully indented entry: a person (or ``grep``) reads
    an image's record on one line, the file is 40% smaller (it is stored up to four times: the
    data set, its DVC cache, the remote, and each split), and a step reads the head without the
    list and the list a line at a time (:mod:`tasks.data.manifest_stream`, which also writes
    this layout one image at a time). Any JSON reader reads it as before; an image's optional
    fields at their defaults are left out.
    """
    # pydantic's own serialiser: 10x the standard json module's speed on a manifest of 10,000
    # images (a quarter of a split's time went to json.dumps); UTF-8, not \u escapes.
    text = manifest.model_copy(update={"images": []}).model_dump_json(indent=2)
    if manifest.images:
        # Without the optional fields at their defaults ("source_path": null on nearly every
        # line): they read back the same.
        lines = ",\n    ".join(e.model_dump_json(exclude_defaults=True) for e in manifest.images)
        text = text.removesuffix('\n  "images": []\n}') + f'\n  "images": [\n    {lines}\n  ]\n}}'
    return write_text(Path(root) / MANIFEST, text + "\n")


def require_labeled(manifest: Manifest, role: str, root: Path | str = "") -> None:
    """Azure rule: training needs a labeled image directory."""
    if not manifest.labeled or not manifest.classes:
        raise NotLabeledDatasetError(
            f"The {role} dataset {root} is not labeled (no class sub-folders).",
            "Convert a folder whose images sit in one sub-folder per class, or a labeled archive.",
        )


def require_same_classes(train: Manifest, val: Manifest) -> None:
    """Azure rule: training and validation data must have the same label categories."""
    if train.classes != val.classes:
        only_train = sorted(set(train.classes) - set(val.classes))
        only_val = sorted(set(val.classes) - set(train.classes))
        raise InvalidDatasetError(
            "Training and validation datasets have different classes "
            f"(only in training: {only_train or 'none'}; "
            f"only in validation: {only_val or 'none'}).",
            "Split one ImageDirectory with `imageops split` so both halves share the classes.",
        )
