"""Convert to Image Directory: raw images (a folder or an archive) become an ImageDirectory.

Class sub-folders are labels; a folder with images directly in it is unlabeled (for scoring).
Archives (.zip, .tar, .tar.gz/.tgz, .tar.bz2) are extracted safely first (see
:mod:`tasks.archive`); a single folder wrapping everything in an archive is unwrapped, so zipping a
folder converts exactly like the folder. Every file is opened, checked against its extension,
verified and fully decoded, in parallel on all cores; the ones that fail are skipped and listed in
the manifest with the reason, and the good ones are copied byte for byte with their sha256 and size
recorded. Identical images are kept but listed, since they leak between a training and a validation
split.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from models.atomic import atomic_directory
from tasks.archive import (
    ARCHIVE_SUFFIXES,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_MEMBERS,
    archive_kind,
    extract_archive,
)
from tasks.errors import InvalidParameterError, NoUsableImagesError
from tasks.imagecheck import DEFAULT_MAX_PIXELS, CheckJob, CheckResult, check_file
from tasks.imagedir import (
    MANIFEST,
    ImageEntry,
    Manifest,
    SkippedFile,
    SkipReason,
    find_duplicates,
    is_image_file,
    write_manifest,
)
from tasks.step import step

log = logging.getLogger(__name__)

# Starting a process pool costs about a second (each worker is a fresh interpreter), while checking
# a small image takes well under a millisecond: below these sizes the pool costs more than it saves.
# An explicit ``workers`` skips the byte rule (the caller asked for processes).
MIN_FILES_FOR_POOL = 64
MIN_BYTES_FOR_POOL = 16 * 1024**2
# macOS and Windows leave these beside the images; they are never data.
_JUNK_NAMES = ("__MACOSX",)


@dataclass
class _Scan:
    """What is below the source root: the files to check, and what was left out already."""

    labeled: bool
    files: list[tuple[Path, str]] = field(default_factory=list)  # (absolute path, relative path)
    class_dirs: list[str] = field(default_factory=list)
    skipped: list[SkippedFile] = field(default_factory=list)


def convert(
    source: Path,
    dest: Path,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    workers: int | None = None,
    max_archive_members: int = DEFAULT_MAX_MEMBERS,
    max_archive_bytes: int = DEFAULT_MAX_BYTES,
) -> Manifest:
    """Convert the image folder or archive ``source`` into the ImageDirectory ``dest``.

    ``dest`` is written atomically: it appears complete or not at all, and an existing ``dest`` is
    replaced only once the new one is whole. ``max_pixels`` refuses decompression bombs per image
    (reason ``ImageExceedsLimit``). ``workers`` is the number of processes checking images: by
    default every core this process may use, once the input is big enough to gain from them
    (1 checks in this process). ``max_archive_members`` and ``max_archive_bytes`` cap what an
    archive may unpack to.

    Returns the manifest written. Raises :class:`InvalidParameterError` for a parameter out of
    range or a ``dest`` that overlaps ``source``, :class:`UnsafeArchiveError` for an archive over
    the caps, and :class:`NoUsableImagesError` when the source is missing, unreadable, or holds no
    usable image.
    """
    source, dest = Path(source), Path(dest)
    _check_parameters(source, dest, max_pixels, workers, max_archive_members, max_archive_bytes)
    if source.is_dir():
        return _convert_folder(source, dest, source, [], max_pixels, workers)
    if not source.exists():
        raise NoUsableImagesError(
            f"{source} does not exist.", "Pass a folder of images or an archive of one."
        )
    if archive_kind(source) is None:
        raise NoUsableImagesError(
            f"{source} is neither a folder nor an archive imageops reads.",
            f"Pass a folder of images (class sub-folders = labels) or one of: "
            f"{', '.join(ARCHIVE_SUFFIXES)}.",
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Extract beside dest, not in /tmp: same disk as the result, and /tmp is often small.
    with tempfile.TemporaryDirectory(prefix=f".{dest.name}.extract-", dir=dest.parent) as tmp:
        extracted = Path(tmp)
        refused = extract_archive(
            source, extracted, max_members=max_archive_members, max_bytes=max_archive_bytes
        )
        root, junk = _unwrap(extracted)
        return _convert_folder(root, dest, source, refused + junk, max_pixels, workers)


def _check_parameters(
    source: Path,
    dest: Path,
    max_pixels: int,
    workers: int | None,
    max_members: int,
    max_bytes: int,
) -> None:
    for name, value in (
        ("max_pixels", max_pixels),
        ("max_archive_members", max_members),
        ("max_archive_bytes", max_bytes),
    ):
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
        scan.skipped.append(SkippedFile(path=_printable(rel), reason=reason))

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
            if not _utf8(rel):
                skip(rel, SkipReason.BAD_FILE_NAME.because("the name is not UTF-8"))
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


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _convert_folder(
    root: Path,
    dest: Path,
    source: Path,
    skipped: list[SkippedFile],
    max_pixels: int,
    workers: int | None,
) -> Manifest:
    scan = _scan(root)
    skipped = skipped + scan.skipped
    with atomic_directory(dest) as tmp:
        jobs = [CheckJob(str(path), rel, str(tmp / rel), max_pixels) for path, rel in scan.files]
        results = _check_all(jobs, workers)
        images: list[ImageEntry] = []
        accepted: list[tuple[CheckResult, str | None]] = []
        for result in results:
            if result.reason:
                skipped.append(SkippedFile(path=result.rel, reason=result.reason))
            else:
                accepted.append((result, result.rel.split("/", 1)[0] if scan.labeled else None))
        classes = sorted({name for _, name in accepted if name is not None})
        for name in scan.class_dirs:
            if name not in classes:
                skipped.append(
                    SkippedFile(
                        path=_printable(name) + "/",
                        reason=SkipReason.EMPTY_CLASS.because(
                            "no valid image in this class folder; the class is left out"
                        ),
                    )
                )
        class_id = {name: i for i, name in enumerate(classes)}
        for result, name in accepted:
            images.append(
                ImageEntry(
                    path=result.rel,
                    label=None if name is None else class_id[name],
                    sha256=result.sha256,
                    width=result.width,
                    height=result.height,
                )
            )
        if not images:
            raise NoUsableImagesError(_nothing_usable(source, skipped), _NOTHING_USABLE_HINT)
        manifest = Manifest(
            labeled=scan.labeled,
            classes=classes,
            counts={c: sum(1 for e in images if e.label == i) for i, c in enumerate(classes)},
            images=images,
            source=str(source.resolve()),
            skipped=sorted(skipped, key=lambda s: s.path),
            duplicates=find_duplicates(images),
        )
        write_manifest(tmp, manifest)
    _log_summary(dest, manifest)
    return manifest


_NOTHING_USABLE_HINT = (
    "Pass a folder (or archive) of .jpg/.png/... images, in one sub-folder per class for a "
    "labeled set; check that the files open in an image viewer."
)


def _nothing_usable(source: Path, skipped: Sequence[SkippedFile]) -> str:
    if not skipped:
        return f"No usable image in {source}: it holds no files."
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
        if sum(_size(job.source) for job in jobs) < MIN_BYTES_FOR_POOL:
            return 0
        workers = _available_cores()
    return min(workers, len(jobs))


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _check_all(jobs: list[CheckJob], workers: int | None) -> list[CheckResult]:
    """Run :func:`check_file` on every job, in a process pool unless the input is small.

    Spawn, never fork: forking a process that runs Prefect's threads can deadlock the child.
    Results come back in job order, so the manifest does not depend on scheduling.
    """
    workers = _use_pool(jobs, workers)
    with _progress(len(jobs)) as advance:
        if workers <= 1:
            return [advance(check_file(job)) for job in jobs]
        # Chunks amortise the round trip per file, and stay small enough to balance the load.
        chunksize = max(1, min(32, len(jobs) // (workers * 4)))
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            return [advance(r) for r in pool.map(check_file, jobs, chunksize=chunksize)]


@contextmanager
def _progress(total: int) -> Iterator[Callable[[CheckResult], CheckResult]]:
    """A rich progress bar on a terminal; nothing in logs, CI or a Prefect worker."""
    if not sys.stderr.isatty():
        yield lambda result: result
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

        def advance(result: CheckResult) -> CheckResult:
            bar.advance(task)
            return result

        yield advance


convert_task = step(convert, name="convert")
