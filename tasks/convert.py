"""Convert to Image Directory: a folder, an archive or a label file becomes an ImageDirectory.

Class sub-folders are labels; a folder with images directly in it is unlabeled (for scoring).
Archives (.zip, .tar, .tar.gz/.tgz, .tar.bz2) are extracted safely first (see
:mod:`tasks.archive`); a single folder wrapping everything in an archive is unwrapped, so zipping a
folder converts exactly like the folder. A CSV manifest (``path,label``) or a COCO classification
JSON names the images and their labels instead (see :mod:`tasks.labelfiles`); each image is copied
to ``<class>/<its file name>``, a name taken already gets ``_1``, ``_2``... Every file is opened,
checked against its extension, verified and fully decoded, in parallel on all cores; the ones that
fail are skipped and listed in the manifest with the reason, and the good ones are copied byte for
byte with their sha256 and size recorded. Identical images are kept but listed, since they leak
between a training and a validation split.

Converting again is a cache hit when nothing changed: the manifest keeps a fingerprint of what was
read (the bytes, never the timestamps, so the same images give the same directory and the same
DVC version wherever they are converted) and of the parameters. When ``dest`` already holds a
manifest with the fingerprint the source has now, and every file it lists is there with its size,
that manifest is returned: the source is read and hashed, but nothing is decoded or written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import stat
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any

from models.atomic import atomic_directory, check_destination, remove_leftovers, scratch_folder
from tasks.archive import (
    ARCHIVE_SUFFIXES,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_MEMBER_BYTES,
    DEFAULT_MAX_MEMBERS,
    DEFAULT_MAX_RATIO,
    archive_kind,
    extract_archive,
    zip_names,
)
from tasks.errors import (
    ImageOpsError,
    InvalidDatasetError,
    InvalidParameterError,
    NotLabeledDatasetError,
    NoUsableImagesError,
)
from tasks.imagecheck import (
    DEFAULT_MAX_ASPECT_RATIO,
    DEFAULT_MAX_PIXELS,
    CheckJob,
    CheckResult,
    check_file,
    check_files,
    file_fingerprint,
    refused_unread,
)
from tasks.imagedir import (
    FORMAT_VERSION,
    MANIFEST,
    ImageEntry,
    Manifest,
    SkippedFile,
    SkipReason,
    find_duplicates,
    is_image_file,
    is_utf8,
    printable_name,
    read_manifest,
    write_manifest,
)
from tasks.labelfiles import Listed, label_file_kind, read_label_file
from tasks.parent_death import die_with_parent
from tasks.step import step

log = logging.getLogger(__name__)

# Starting a process pool costs about a second (each worker is a fresh interpreter), while checking
# a small image takes well under a millisecond: below these sizes the pool costs more than it saves.
# An explicit ``workers`` skips the byte rule (the caller asked for processes).
MIN_FILES_FOR_POOL = 64
MIN_BYTES_FOR_POOL = 16 * 1024**2
# macOS and Windows leave these beside the images; they are never data.
_JUNK_NAMES = ("__MACOSX",)
# Part of every fingerprint: bump it when a change here or in tasks.imagecheck can change the
# result for the same input, so directories converted before are converted again.
# 2: the aspect-ratio limit; files refused by extension or size are no longer read.
_CONVERTER_VERSION = 2
# Files per task when hashing for the cache check; one chunk or less is hashed in this thread.
_HASH_CHUNK = 64


@dataclass
class _Scan:
    """What is below the source root: the files to check, and what was left out already."""

    labeled: bool
    files: list[tuple[Path, str]] = field(default_factory=list)  # (absolute path, relative path)
    class_dirs: list[str] = field(default_factory=list)
    skipped: list[SkippedFile] = field(default_factory=list)


@dataclass(frozen=True)
class _Item:
    """One file to check, and where it goes when it passes."""

    source: str  # the file to read
    rel: str  # its path relative to the source root (or the label file's folder)
    dest: str  # its path in the ImageDirectory
    label: str | None  # its class name
    origin: str | None = None  # recorded as the entry's source_path (label files)


@dataclass
class _Plan:
    """Everything to convert, before any file is opened."""

    labeled: bool
    items: list[_Item]
    classes: list[str]  # the classes the source names: each one left without images is reported
    skipped: list[SkippedFile]
    label_file: bool = False


def convert(
    source: Path,
    dest: Path,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_aspect_ratio: int = DEFAULT_MAX_ASPECT_RATIO,
    workers: int | None = None,
    max_archive_members: int = DEFAULT_MAX_MEMBERS,
    max_archive_bytes: int = DEFAULT_MAX_BYTES,
    max_archive_member_bytes: int = DEFAULT_MAX_MEMBER_BYTES,
    max_archive_ratio: int = DEFAULT_MAX_RATIO,
) -> Manifest:
    """Convert the image folder, archive or label file ``source`` into the ImageDirectory ``dest``.

    ``source`` is a folder (class sub-folders = labels, else unlabeled), an archive of one, a CSV
    manifest (``.csv``, header ``path,label``) or a COCO classification JSON (``.json``).
    ``dest`` is written atomically: it appears complete or not at all, and an existing ``dest`` is
    replaced only once the new one is whole. When ``dest`` already holds the conversion of this
    very source (same content, same parameters) and is intact, its manifest is returned and
    nothing is written. ``max_pixels`` (width x height) and ``max_aspect_ratio`` (longer side
    over shorter side) refuse decompression bombs and slivers per image, from the header (reason
    ``ImageExceedsLimit``); the other steps read images with the same limits' defaults
    (:mod:`tasks.imageformat`). ``workers`` is the number of processes checking images, this one
    included: by default every core this process may use, once the input is big enough to gain
    from them (1 checks in this process only). ``max_archive_members``, ``max_archive_bytes``
    (in total), ``max_archive_member_bytes`` (per member) and ``max_archive_ratio`` (inflated
    over compressed size, per member and in total) cap what an archive may unpack to (see
    :mod:`tasks.archive`).

    Returns the manifest written (or found). Raises :class:`InvalidParameterError` for a
    parameter out of range or a ``dest`` that overlaps ``source``, :class:`UnsafeArchiveError`
    for an archive over the caps, :class:`InvalidLabelFileError` for a label file that cannot be
    read as a whole, and :class:`NoUsableImagesError` when the source is missing, unreadable, or
    holds no usable image.
    """
    source, dest = Path(source), Path(dest)
    limits = {"max_pixels": max_pixels, "max_aspect_ratio": max_aspect_ratio}
    caps = {
        "max_archive_members": max_archive_members,
        "max_archive_bytes": max_archive_bytes,
        "max_archive_member_bytes": max_archive_member_bytes,
        "max_archive_ratio": max_archive_ratio,
    }
    _check_parameters(source, dest, workers, limits | caps)
    check_destination(dest, replaces=MANIFEST)
    # A killed run's leftovers beside dest: removed even when the cache check below writes nothing.
    remove_leftovers(dest)
    remove_leftovers(dest, "extract")
    kind = _source_kind(source)
    params: dict[str, int] = dict(limits)
    if kind == "archive":
        params |= caps  # a smaller cap could refuse an archive a larger one let through
    head = {
        "converter": _CONVERTER_VERSION,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "parameters": params,
        # An archive or a label file is read whole anyway: its own bytes are part of the key.
        "input_sha256": None if kind == "folder" else _sha256_file(source)[1],
    }
    previous = _previous(dest, source)
    if kind == "archive":
        fingerprint = _fingerprint(head)
        if previous is not None and previous.fingerprint == fingerprint:
            return _unchanged(dest, previous)
        # Beside dest, locked while in use: a killed run's extraction is removed by the next.
        with scratch_folder(dest, "extract") as extracted:
            refused = extract_archive(
                source,
                extracted,
                max_members=max_archive_members,
                max_bytes=max_archive_bytes,
                max_member_bytes=max_archive_member_bytes,
                max_ratio=max_archive_ratio,
            )
            root, junk = _unwrap(extracted)
            plan = _plan_folder(root, refused + junk)
            return _convert_plan(plan, dest, source, limits, workers, fingerprint)
    plan = _plan_folder(source, []) if kind == "folder" else _plan_label_file(source, dest)
    if previous is not None and previous.fingerprint == _fingerprint(
        head, plan, _hash_all(plan.items, max_pixels)
    ):
        return _unchanged(dest, previous)
    return _convert_plan(plan, dest, source, limits, workers, head)


def source_classes(source: Path) -> list[str]:
    """The classes a source's layout names, read without converting it (no image is decoded).

    For refusing, before a pipeline starts, a source no classifier can learn from: folders and
    archives by their class sub-folders (the first folder of each path, after the wrapper
    folder a zip often has), label files by their labels. Raises NoUsableImagesError for a
    missing or unreadable source, NotLabeledDatasetError when the layout has no classes, and
    InvalidDatasetError for fewer than two.
    """
    source = Path(source)
    kind = _source_kind(source)
    if kind in ("csv", "coco"):
        listing = read_label_file(source)
        classes = listing.classes if listing.labeled else []
    else:
        classes = _layout_classes(_paths_in(source) if kind == "archive" else None, source)
    if not classes:
        raise NotLabeledDatasetError(
            f"{source} has no class sub-folders: its images are not labeled, and training "
            "needs labels.",
            "Put each class's images in a sub-folder named after the class (raw/cat/1.jpg, "
            "raw/dog/2.jpg), or pass a CSV (path,label) or COCO label file. To score unlabeled "
            "images with a trained model, use `imageops score`.",
        )
    if len(classes) < 2:
        raise InvalidDatasetError(
            f"{source} has only the class {classes[0]!r}; a classifier needs two or more.",
            "Add a sub-folder of images for each other class.",
        )
    return classes


def _paths_in(archive: Path) -> list[str]:
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


def _layout_classes(names: list[str] | None, folder: Path) -> list[str]:
    """Class folders of a folder (``names`` None) or of an archive's member names, as _scan
    decides them: labeled when no image sits at the top and there are sub-folders."""
    if names is None:  # a folder is read as it is (only an archive's wrapper is unwrapped)
        entries = [(p.name, p.is_dir() and not p.is_symlink()) for p in folder.iterdir()]
    else:
        parts = [PurePosixPath(n).parts for n in names if n and not n.endswith("/")]
        parts = [p for p in parts if p and not any(_is_hidden(x) for x in p)]
        tops = {p[0] for p in parts}
        if len(tops) == 1 and all(len(p) > 1 for p in parts):  # one wrapper folder
            parts = [p[1:] for p in parts]
        entries = [(p[0], len(p) > 1) for p in parts]
    visible = [(name, is_dir) for name, is_dir in entries if not _is_hidden(name)]
    if any(not is_dir and is_image_file(Path(name)) for name, is_dir in visible):
        return []
    return sorted({name for name, is_dir in visible if is_dir})


def _source_kind(source: Path) -> str:
    """``folder``, ``archive``, ``csv`` or ``coco``; NoUsableImagesError for anything else."""
    if source.is_dir():
        return "folder"
    if not source.exists():
        raise NoUsableImagesError(
            f"{source} does not exist.",
            "Pass a folder of images, an archive of one, or a CSV / COCO JSON label file.",
        )
    if archive_kind(source) is not None:
        return "archive"
    kind = label_file_kind(source)
    if kind is None:
        raise NoUsableImagesError(
            f"{source} is neither a folder nor an archive or label file imageops reads.",
            f"Pass a folder of images (class sub-folders = labels), one of: "
            f"{', '.join(ARCHIVE_SUFFIXES)}, or a .csv (path,label) or COCO .json label file.",
        )
    return kind


def _check_parameters(
    source: Path, dest: Path, workers: int | None, limits: dict[str, int]
) -> None:
    for name, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidParameterError(f"{name} must be a whole number >= 1, got {value!r}.")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)):
        raise InvalidParameterError(f"workers must be a whole number >= 1, got {workers!r}.")
    if workers is not None and workers < 1:
        raise InvalidParameterError(
            f"workers must be >= 1, got {workers}.", "Leave it out to use every core."
        )
    src, dst = source.resolve(), dest.resolve()
    if src == dst or src.is_relative_to(dst) or dst.is_relative_to(src):
        # Replacing dest would delete the source, or the output would be read as input.
        raise InvalidParameterError(
            f"dest {dest} and source {source} overlap.",
            "Write the ImageDirectory to a folder outside the source, e.g. data/images.",
        )


def _is_hidden(name: str) -> bool:
    return name.startswith(".") or name in _JUNK_NAMES


def _unwrap(root: Path) -> tuple[Path, list[SkippedFile]]:
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
                scan.files.append((path, rel))
    scan.files.sort(key=lambda item: item[1])
    return scan


def _stays_in(base: str, link: Path) -> bool:
    """Whether the symlink ``link`` resolves to a place under ``base`` (a realpath)."""
    return os.path.commonpath([base, os.path.realpath(link)]) == base


def _plan_folder(root: Path, skipped: list[SkippedFile]) -> _Plan:
    scan = _scan(root)
    items = [
        _Item(str(path), rel, rel, rel.split("/", 1)[0] if scan.labeled else None)
        for path, rel in scan.files
    ]
    return _Plan(scan.labeled, items, scan.class_dirs, skipped + scan.skipped)


def _plan_label_file(source: Path, dest: Path) -> _Plan:
    listing = read_label_file(source, exclude=dest)
    names = _unique_names(listing.entries, listing.labeled)
    items = [
        _Item(str(entry.path), entry.rel, names[entry.rel], entry.label, entry.rel)
        for entry in listing.entries
    ]
    return _Plan(listing.labeled, items, listing.classes, listing.skipped, label_file=True)


def _unique_names(entries: Sequence[Listed], labeled: bool) -> dict[str, str]:
    """Where each listed file goes: ``<class>/<file name>`` (``<file name>`` when unlabeled).

    Files from different folders may share a name. The first one (in path order) keeps it; the
    others get ``<stem>_1<suffix>``, ``_2``..., skipping names that are taken. Names are compared
    without case, so the directory also copies to macOS and Windows intact. The result depends
    only on the set of files, never on the order the label file lists them.
    """
    folders: dict[str, list[Listed]] = {}
    for entry in sorted(entries, key=lambda e: e.rel):
        folders.setdefault((entry.label or "") if labeled else "", []).append(entry)
    names: dict[str, str] = {}
    for folder, members in folders.items():
        prefix = f"{folder}/" if folder else ""
        taken: set[str] = set()
        later: list[Listed] = []
        for entry in members:  # first pass: every name its first holder keeps
            name = PurePosixPath(entry.rel).name
            if name.casefold() in taken:
                later.append(entry)
            else:
                taken.add(name.casefold())
                names[entry.rel] = prefix + name
        for entry in later:
            name = PurePosixPath(PurePosixPath(entry.rel).name)
            n = 1
            while f"{name.stem}_{n}{name.suffix}".casefold() in taken:
                n += 1
            free = f"{name.stem}_{n}{name.suffix}"
            taken.add(free.casefold())
            names[entry.rel] = prefix + free
    return names


def _convert_plan(
    plan: _Plan,
    dest: Path,
    source: Path,
    limits: dict[str, int],
    workers: int | None,
    fingerprint: str | dict[str, Any],
) -> Manifest:
    """Check every planned file, copy the good ones into a new ``dest``, write the manifest.

    ``fingerprint`` is the final value, or the head of one to finish with the hashes the workers
    computed of the files they read (no file is read twice).
    """
    skipped = list(plan.skipped)
    with atomic_directory(dest, replaces=MANIFEST) as tmp:
        jobs = [
            CheckJob(item.source, item.rel, str(tmp / item.dest), scratch=str(tmp), **limits)
            for item in plan.items
        ]
        results = _check_all(jobs, workers)
        accepted: list[tuple[_Item, CheckResult]] = []
        for item, result in zip(plan.items, results, strict=True):
            if result.reason:
                skipped.append(SkippedFile(path=result.rel, reason=result.reason))
            else:
                accepted.append((item, result))
        classes = sorted({item.label for item, _ in accepted if item.label is not None})
        what = "class" if plan.label_file else "class folder"
        for name in plan.classes:
            if name not in classes:
                skipped.append(
                    SkippedFile(
                        path=printable_name(name) + "/",
                        reason=SkipReason.EMPTY_CLASS.because(
                            f"no valid image in this {what}; the class is left out"
                        ),
                    )
                )
        class_id = {name: i for i, name in enumerate(classes)}
        images = sorted(
            (
                ImageEntry(
                    path=item.dest,
                    label=None if item.label is None else class_id[item.label],
                    sha256=result.sha256,
                    width=result.width,
                    height=result.height,
                    size=result.size,
                    source_path=item.origin,
                )
                for item, result in accepted
            ),
            key=lambda entry: entry.path,
        )
        if not images:
            raise NoUsableImagesError(
                _nothing_usable(source, skipped, plan.label_file),
                _LABEL_FILE_HINT if plan.label_file else _NOTHING_USABLE_HINT,
            )
        if isinstance(fingerprint, dict):
            fingerprint = _fingerprint(fingerprint, plan, [(r.size, r.sha256) for r in results])
        manifest = Manifest(
            labeled=plan.labeled,
            classes=classes,
            counts={c: sum(1 for e in images if e.label == i) for i, c in enumerate(classes)},
            images=images,
            source=str(source.resolve()),
            skipped=sorted(skipped, key=lambda s: s.path),
            duplicates=find_duplicates(images),
            fingerprint=fingerprint,
        )
        write_manifest(tmp, manifest)
    _log_summary(dest, manifest)
    return manifest


# --- the cache --------------------------------------------------------------------------------


def _fingerprint(
    head: dict[str, Any],
    plan: _Plan | None = None,
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


def _sha256_file(path: str | Path) -> tuple[int, str]:
    try:
        with open(path, "rb") as fh:
            digest = hashlib.file_digest(fh, "sha256")
            return fh.tell(), digest.hexdigest()
    except OSError:
        return -1, ""


def _hash_all(items: Sequence[_Item], max_pixels: int) -> list[tuple[int, str]]:
    """(size, sha256) of each file, as :func:`tasks.imagecheck.check_file` reports them (a file
    it would not read, by its extension or size, is not read here either).

    Threads, not processes: reading and hashing release the GIL, and a thread starts at once.
    From the page cache one thread is as fast; the others help when the disk makes us wait.
    """
    files = [(item.source, item.rel) for item in items]
    chunks = [files[i : i + _HASH_CHUNK] for i in range(0, len(files), _HASH_CHUNK)]
    if len(chunks) <= 1:
        return _hash_chunk(files, max_pixels)
    with ThreadPoolExecutor(max_workers=min(8, 2 * _available_cores())) as pool:
        hashed = pool.map(partial(_hash_chunk, max_pixels=max_pixels), chunks)
        return [d for chunk in hashed for d in chunk]


def _hash_chunk(files: Sequence[tuple[str, str]], max_pixels: int) -> list[tuple[int, str]]:
    return [file_fingerprint(source, rel, max_pixels) for source, rel in files]


def _previous(dest: Path, source: Path) -> Manifest | None:
    """The manifest in ``dest`` when it may be a cache hit, else None.

    That is: converted from ``source``, with a fingerprint, and every file it lists still there
    with its size (and nothing else).
    """
    if not (dest / MANIFEST).is_file():
        return None
    try:
        manifest = read_manifest(dest)
    except (ImageOpsError, OSError):
        return None  # not a directory we can trust: convert again, replacing it
    if manifest.fingerprint is None or manifest.source != str(source.resolve()):
        return None
    return manifest if _intact(dest, manifest) else None


def _intact(dest: Path, manifest: Manifest) -> bool:
    """Every listed file is a regular file of the recorded size, and no other file is there.

    Sizes, not hashes: this check is a stat per file. A file changed in place with its size
    kept goes unnoticed, as it does for DVC's own status.
    """
    expected = {entry.path: entry.size for entry in manifest.images}
    if None in expected.values():
        return False  # written before sizes were recorded
    found: dict[str, int] = {}
    for folder, _dirnames, filenames in os.walk(dest):
        for name in filenames:
            path = os.path.join(folder, name)
            try:
                info = os.lstat(path)
            except OSError:  # gone while we looked: not intact
                return False
            if not stat.S_ISREG(info.st_mode):
                return False
            found[Path(path).relative_to(dest).as_posix()] = info.st_size
    return found.pop(MANIFEST, None) is not None and found == expected


def _unchanged(dest: Path, manifest: Manifest) -> Manifest:
    log.info(
        "%s is up to date: the source and parameters have not changed since it was converted "
        "(%d images); nothing to do.",
        dest,
        len(manifest.images),
    )
    return manifest


_NOTHING_USABLE_HINT = (
    "Pass a folder (or archive) of .jpg/.png/... images, in one sub-folder per class for a "
    "labeled set; check that the files open in an image viewer."
)
_LABEL_FILE_HINT = (
    "Check that the paths in the label file are relative to its folder, that the files are "
    "there, and that they open in an image viewer."
)


def _nothing_usable(source: Path, skipped: Sequence[SkippedFile], label_file: bool) -> str:
    if not skipped:
        return f"No usable image in {source}: it {'lists' if label_file else 'holds'} no files."
    by_code: dict[str, int] = {}
    for item in skipped:
        code = item.reason.split(":", 1)[0]
        by_code[code] = by_code.get(code, 0) + 1
    summary = ", ".join(f"{n} {code}" for code, n in sorted(by_code.items()))
    first = next((s for s in skipped if not s.path.endswith("/")), skipped[0])
    return (
        f"No usable image in {source}: everything was skipped ({summary}); "
        f"for example {first.path} ({first.reason})."
    )


def _log_summary(dest: Path, manifest: Manifest) -> None:
    log.info(
        "Converted %d image(s) into %s (%s, %d skipped).",
        len(manifest.images),
        dest,
        f"{len(manifest.classes)} classes" if manifest.labeled else "unlabeled",
        len(manifest.skipped),
    )
    if manifest.skipped:
        log.warning("%d file(s) skipped; see `skipped` in %s.", len(manifest.skipped), MANIFEST)
    if manifest.duplicates:
        log.warning(
            "%d group(s) of identical images; see `duplicates` in %s.",
            len(manifest.duplicates),
            MANIFEST,
        )


def _available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))  # respects taskset and container CPU sets
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def _use_pool(jobs: list[CheckJob], workers: int | None) -> int:
    """How many worker processes to start; 0 or 1 means check in this process."""
    if len(jobs) < MIN_FILES_FOR_POOL:
        return 0
    if workers is None:
        if sum(_size(job) for job in jobs) < MIN_BYTES_FOR_POOL:
            return 0
        workers = _available_cores()
    return min(workers, len(jobs))


def _size(job: CheckJob) -> int:
    """The bytes checking ``job`` reads: none for a file refused by its extension or size."""
    try:
        size = os.path.getsize(job.source)
    except OSError:
        return 0
    return 0 if refused_unread(job.rel, size, job.max_pixels) else size


def _check_all(jobs: list[CheckJob], workers: int | None) -> list[CheckResult]:
    """Run :func:`check_file` on every job, in a process pool unless the input is small.

    This process is one of the ``workers``: the others are spawned and take chunks of jobs from
    the front while this one checks chunks from the back, so the work starts at once instead of
    after an interpreter start-up (a tenth of a second per spawned worker). Spawn, never fork:
    forking a process that runs Prefect's threads can deadlock the child. Results come back in
    job order, so the manifest does not depend on scheduling.
    """
    workers = _use_pool(jobs, workers)
    with _progress(len(jobs)) as advance:
        if workers <= 1:
            return [_advanced(advance, check_file(job)) for job in jobs]
        # Chunks amortise the round trip per file, and stay small enough to balance the load.
        size = max(1, min(32, len(jobs) // (workers * 4)))
        chunks = [jobs[i : i + size] for i in range(0, len(jobs), size)]
        mine: dict[int, list[CheckResult]] = {}
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            max_workers=workers - 1,
            mp_context=context,
            initializer=die_with_parent,  # a SIGKILLed convert leaves no worker behind
            initargs=(os.getpid(),),
        ) as pool:
            try:
                futures = [pool.submit(check_files, chunk) for chunk in chunks]
                for future, chunk in zip(futures, chunks, strict=True):
                    future.add_done_callback(partial(_chunk_done, advance, len(chunk)))
                for i in reversed(range(len(chunks))):
                    if not futures[i].cancel():
                        break  # a worker has this chunk already: the ones before are theirs too
                    mine[i] = [_advanced(advance, check_file(job)) for job in chunks[i]]
                return [
                    result
                    for i, future in enumerate(futures)
                    for result in (mine[i] if i in mine else future.result())
                ]
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # not the whole queue first
                raise


def _chunk_done(advance: Callable[[int], None], n: int, future: Future) -> None:
    if not future.cancelled():  # a chunk this process took over counts as it goes
        advance(n)


def _advanced(advance: Callable[[int], None], result: CheckResult) -> CheckResult:
    advance(1)
    return result


@contextmanager
def _progress(total: int) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on a terminal; nothing in logs, CI or a Prefect worker.

    Yields ``advance(n)``, safe to call from any thread.
    """
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("Checking images", total=total)
        yield lambda n: bar.advance(task, n)


convert_task = step(convert, name="convert")
