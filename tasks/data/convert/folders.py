"""Folders as a source: the layout decides the labels (class sub-folders), or there are none.

An archive is extracted into a folder first (:mod:`tasks.data.archive`) and read the same way, after
unwrapping the one folder a zip of a folder holds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tasks.data.archive import archive_kind, zip_names
from tasks.data.convert.plan import ConversionPlan, PlannedFile
from tasks.data.imagedir import (
    MANIFEST,
    SkippedFile,
    SkipReason,
    is_image_file,
    is_utf8,
    printable_name,
)
from tasks.shared.errors import NoUsableImagesError

# macOS and Windows leave these beside the images; they are never data.
_JUNK_NAMES = ("__MACOSX",)


@dataclass
class _Scan:
    """What is below the source root: the files to check, and what was left out already."""

    labeled: bool
    # (absolute path, relative path), as strings: a Path object per file weighs 300 bytes more.
    files: list[tuple[str, str]] = field(default_factory=list)
    class_dirs: list[str] = field(default_factory=list)
    skipped: list[SkippedFile] = field(default_factory=list)


def plan_folder(root: Path, skipped: list[SkippedFile]) -> ConversionPlan:
    """Every file below ``root`` to its own path; ``skipped`` holds what was refused before."""
    scan = _scan(root)
    names: dict[str, str] = {}  # one string per class, not one per image
    items = [
        PlannedFile(
            path,
            rel,
            rel,
            names.setdefault(c, c) if scan.labeled and (c := rel.split("/", 1)[0]) else None,
        )
        for path, rel in scan.files
    ]
    return ConversionPlan(scan.labeled, items, scan.class_dirs, skipped + scan.skipped)


def paths_in(archive: Path) -> list[str]:
    """The member names of an archive (its headers only, nothing extracted)."""
    import tarfile
    import zipfile

    try:
        if archive_kind(archive) == "zip":
            return zip_names(archive)  # decoded as extraction decodes them
        with tarfile.open(archive) as tar:
            return [m.name for m in tar.getmembers() if m.isfile()]
    except (OSError, zipfile.BadZipFile, tarfile.TarError, EOFError) as exc:
        raise NoUsableImagesError(
            f"{archive} cannot be read as an archive ({type(exc).__name__}: {exc}).",
            "Pass an intact .zip or .tar archive, or the folder it was made from.",
        ) from exc


def layout_classes(names: list[str] | None, folder: Path) -> list[str]:
    """Class folders of a folder (``names`` None) or of an archive's member names, as _scan
    decides them: labeled when no image sits at the top and there are sub-folders."""
    if names is None:  # a folder is read as it is (only an archive's wrapper is unwrapped)
        entries = [(p.name, p.is_dir() and not p.is_symlink()) for p in folder.iterdir()]
    else:
        entries = [(p[0], len(p) > 1) for p in _member_parts(names)]
    visible = [(name, is_dir) for name, is_dir in entries if not _is_hidden(name)]
    if any(not is_dir and is_image_file(Path(name)) for name, is_dir in visible):
        return []
    return sorted({name for name, is_dir in visible if is_dir})


def archive_class_sizes(names: list[str], archive: Path) -> dict[str, int]:
    """Image files per class among an archive's member names (no member extracted): no more
    than convert can keep of each class; {} for an unlabeled layout."""
    classes = layout_classes(names, archive)
    sizes = dict.fromkeys(classes, 0)
    for parts in _member_parts(names):
        if len(parts) > 1 and parts[0] in sizes and is_image_file(PurePosixPath(parts[-1])):
            sizes[parts[0]] += 1
    return sizes


def _member_parts(names: list[str]) -> list[tuple[str, ...]]:
    """The path parts of an archive's files as extraction and unwrap() leave them: hidden ones
    left out, the one wrapper folder a zip of a folder has taken off."""
    parts = [PurePosixPath(n).parts for n in names if n and not n.endswith("/")]
    parts = [p for p in parts if p and not any(_is_hidden(x) for x in p)]
    tops = {p[0] for p in parts}
    if len(tops) == 1 and all(len(p) > 1 for p in parts):  # one wrapper folder
        parts = [p[1:] for p in parts]
    return parts


def _is_hidden(name: str) -> bool:
    return name.startswith(".") or name in _JUNK_NAMES


def unwrap(root: Path) -> tuple[Path, list[SkippedFile]]:
    """The folder that holds the data: ``root``, or its one sub-folder if nothing else is there.

    ``zip -r photos.zip photos/`` wraps everything in ``photos/``; without unwrapping, a labeled
    set would become one class named ``photos``. Junk beside the wrapper (``__MACOSX``) is reported.
    """
    entries = sorted(root.iterdir(), key=lambda p: p.name)
    visible = [p for p in entries if not _is_hidden(p.name)]
    if len(visible) == 1 and visible[0].is_dir() and not visible[0].is_symlink():
        junk = [
            SkippedFile(path=p.name, reason=SkipReason.HIDDEN_FILE.because("hidden or system"))
            for p in entries
            if _is_hidden(p.name)
        ]
        return visible[0], junk
    return root, []


def _scan(root: Path) -> _Scan:
    """Find the files and decide the layout.

    Labeled when no image sits directly in ``root`` and there is at least one sub-folder: then
    the first folder of each path is its class (nested folders below a class belong to it, as in
    torchvision's ImageFolder). Otherwise unlabeled: every image anywhere below ``root``.
    Non-image files at the top (a README, a labels.csv) do not change the layout.
    """
    top_files = [p for p in root.iterdir() if p.is_file() and not _is_hidden(p.name)]
    top_dirs = sorted(
        p.name
        for p in root.iterdir()
        if p.is_dir() and not p.is_symlink() and not _is_hidden(p.name)
    )
    labeled = bool(top_dirs) and not any(is_image_file(p) for p in top_files)
    scan = _Scan(labeled=labeled, class_dirs=top_dirs if labeled else [])

    def skip(rel: str, reason: str) -> None:
        scan.skipped.append(SkippedFile(path=printable_name(rel), reason=reason))

    base = os.path.realpath(root)
    for folder, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(folder)
        for name in sorted(dirnames):
            path = here / name
            rel = path.relative_to(root).as_posix()
            if _is_hidden(name):
                skip(rel + "/", SkipReason.HIDDEN_FILE.because("hidden or system folder"))
            elif path.is_symlink():
                # Not followed: a link can point anywhere, or back up into a loop.
                skip(
                    rel + "/", SkipReason.SYMLINKED_FOLDER.because("folder links are not followed")
                )
        dirnames[:] = sorted(n for n in dirnames if not _is_hidden(n))
        for name in sorted(filenames):
            path = here / name
            rel = path.relative_to(root).as_posix()
            if here == root and name == MANIFEST:
                continue  # the source is itself an ImageDirectory: its manifest is not data
            if not is_utf8(rel):
                skip(rel, SkipReason.BAD_FILE_NAME.because("the name is not UTF-8"))
            elif path.is_symlink() and not _stays_in(base, path):
                # As the CSV and COCO routes refuse it: the source is what the user gave.
                skip(rel, SkipReason.UNSAFE_PATH.because("a symlink leads outside the source"))
            elif not path.is_file():
                # A FIFO would block the reader forever; a socket or device is never an image.
                skip(rel, SkipReason.NOT_AN_IMAGE.because("not a regular file"))
            elif _is_hidden(name):
                skip(rel, SkipReason.HIDDEN_FILE.because("hidden or system file"))
            elif labeled and here == root:
                # A README or labels.csv beside the class folders: reported, not an image anyway.
                skip(rel, SkipReason.NOT_IN_CLASS_FOLDER.because("files must be in class folders"))
            else:
                scan.files.append((str(path), rel))
    scan.files.sort(key=lambda item: item[1])
    return scan


def _stays_in(base: str, link: Path) -> bool:
    """Whether the symlink ``link`` resolves to a place under ``base`` (a realpath)."""
    return os.path.commonpath([base, os.path.realpath(link)]) == base
