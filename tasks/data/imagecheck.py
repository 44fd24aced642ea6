"""Ingest checks for one image file: is it what its name says, whole, decodable and not a bomb?

It runs in convert's spawned workers, so it imports only Pillow and :mod:`tasks.data.imageformat`.
Memory follows the work, never the input: extension, then file size, then header are checked
before a pixel is decoded; large files are hashed while streamed to a scratch copy, which is
what is checked and kept. Details: docs/images.md#ingest-checks.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import PurePath

from PIL import Image, UnidentifiedImageError

from tasks.data.imageformat import (
    IMAGE_EXTENSIONS,
    MAX_ASPECT_RATIO,
    MAX_PIXELS,
    PIL_FORMATS,
    ImageRefused,
    SkipReason,
    bomb_refused,
    file_over_limit,
    max_file_bytes,
    size_over_limit,
    to_rgb,
)
from tasks.shared.file_hash import file_sha256

DEFAULT_MAX_PIXELS = MAX_PIXELS
DEFAULT_MAX_ASPECT_RATIO = MAX_ASPECT_RATIO
# Files up to this size are read whole (one read, checked from memory: the fast path for the
# images most data sets hold); bigger ones are streamed.
IN_MEMORY_BYTES = 16 * 1024**2
_CHUNK = 1024 * 1024

# The Pillow formats each extension may hold. MPO is how Pillow names a JPEG with extra frames
# (phone cameras write them); PPM covers the whole netpbm family (.pbm, .pgm, .ppm).
_FORMATS_BY_EXTENSION = {
    ".jpg": {"JPEG", "MPO"},
    ".jpeg": {"JPEG", "MPO"},
    ".png": {"PNG"},
    ".ppm": {"PPM"},
    ".pgm": {"PPM"},
    ".bmp": {"BMP"},
    ".tif": {"TIFF"},
    ".tiff": {"TIFF"},
    ".webp": {"WEBP"},
}
assert set(_FORMATS_BY_EXTENSION) == set(IMAGE_EXTENSIONS)

# How the allowed formats start: tells a damaged image from something that never was one.
_MAGIC = (
    b"\x89PNG\r\n\x1a\n",
    b"\xff\xd8\xff",
    b"BM",
    b"II*\x00",
    b"MM\x00*",
    b"RIFF",
    *(f"P{i}".encode() for i in range(1, 8)),
)
ARCHIVE_SUFFIXES = (".zip", ".tar", ".tgz", ".gz", ".bz2", ".tbz2", ".xz", ".7z", ".rar")


@dataclass(frozen=True)
class CheckJob:
    """One file to check and, when it passes, to copy to ``target`` (bytes exactly as read).

    ``scratch``: an existing folder on the target's disk where a big file is streamed to while it
    is hashed, before it is checked.
    """

    source: str
    rel: str
    target: str
    max_pixels: int
    max_aspect_ratio: int
    scratch: str

    def check(self, source: bytes | str) -> tuple[int, int]:
        """:func:`check_image` of the file's bytes (or its scratch copy) under this job's limits."""
        return check_image(
            source,
            PurePath(self.rel).suffix,
            max_pixels=self.max_pixels,
            max_aspect_ratio=self.max_aspect_ratio,
        )


@dataclass(frozen=True)
class CheckResult:
    """What checking found. ``sha256`` and ``size`` describe the bytes read, accepted or not (the
    source's fingerprint covers every file); for a file refused unread (its extension, its size)
    ``sha256`` is "" and ``size`` the size on disk; -1 and "" when the file could not be read."""

    rel: str
    sha256: str = ""
    width: int = 0
    height: int = 0
    reason: str = ""  # empty when the image was accepted and copied
    size: int = -1


def refused_unread(rel: str, size: int, max_pixels: int) -> str | None:
    """Why the file ``rel`` of ``size`` bytes is refused without reading it, or None.

    Its extension says it is not an image, or it is bigger than any image within the limit.
    """
    suffix = PurePath(rel).suffix
    if suffix.lower() not in _FORMATS_BY_EXTENSION:
        return SkipReason.NOT_AN_IMAGE.because(_not_image_detail(suffix))
    return file_over_limit(size, max_pixels)


def file_fingerprint(source: str, rel: str, max_pixels: int) -> tuple[int, str]:
    """``(size, sha256)`` of a file as :func:`check_file` reports it, without checking it.

    For the cache check: a file that checking would not read is not read here either.
    """
    try:
        size = os.stat(source).st_size
        if refused_unread(rel, size, max_pixels):
            return size, ""
        return file_sha256(source)
    except OSError:
        return -1, ""


def check_image(
    source: bytes | str,
    suffix: str,
    *,
    max_pixels: int,
    max_aspect_ratio: int = MAX_ASPECT_RATIO,
) -> tuple[int, int]:
    """Width and height of a valid image; raise :class:`ImageRefused` saying why it is not.

    ``source`` is the file's bytes or its path. The limits are checked from the header, before
    any pixel is decoded, so a decompression bomb costs a few bytes of reading. Pillow's own
    global limit is left as it is: its warning is silenced for this call only (our limit is the
    one that counts), and its hard error (twice its limit) still refuses anything bigger
    whatever ``max_pixels`` says.
    """
    allowed = _FORMATS_BY_EXTENSION.get(suffix.lower())
    if allowed is None:
        raise ImageRefused(SkipReason.NOT_AN_IMAGE.because(_not_image_detail(suffix)))
    if not source:
        raise ImageRefused(SkipReason.EMPTY_FILE.because("the file has zero bytes"))

    def fresh() -> io.BytesIO | str:
        return io.BytesIO(source) if isinstance(source, bytes) else source

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(fresh(), formats=PIL_FORMATS) as img:
                width, height = img.size
                refused = size_over_limit(width, height, max_pixels, max_aspect_ratio)
                if refused:
                    raise ImageRefused(refused)
                if img.format not in allowed:
                    raise ImageRefused(
                        SkipReason.EXTENSION_MISMATCH.because(
                            f"the content is {img.format} but the name ends in {suffix}"
                        )
                    )
                png = img.format == "PNG"
                # Only PNG's verify() checks anything (every chunk's CRC, which decoding skips);
                # for the other formats it is a no-op, and they are decoded right away.
                if png:
                    img.verify()
                else:
                    _decode(img)
            if png:  # verify() leaves the image unusable: decode a fresh one
                with Image.open(fresh(), formats=["PNG"]) as img:
                    _decode(img)
    except ImageRefused:
        raise
    except Image.DecompressionBombError as exc:
        raise bomb_refused(exc, max_pixels) from exc
    except UnidentifiedImageError as exc:
        if _start(source).startswith(_MAGIC):
            raise ImageRefused(
                SkipReason.UNREADABLE_IMAGE.because(
                    "starts like an image but its header is damaged"
                )
            ) from exc
        raise ImageRefused(
            SkipReason.NOT_AN_IMAGE.because(
                f"the content is not a {'/'.join(PIL_FORMATS)} image although it is named {suffix}"
            )
        ) from exc
    except MemoryError:
        raise
    except Exception as exc:  # Pillow raises many types (OSError, SyntaxError, struct.error...)
        raise ImageRefused(
            SkipReason.UNREADABLE_IMAGE.because(f"{type(exc).__name__}: {exc}")
        ) from exc
    return width, height


def _start(source: bytes | str) -> bytes:
    """The first bytes of the file, enough to recognise every format's magic number."""
    if isinstance(source, bytes):
        return source[:8]
    with open(source, "rb") as fh:
        return fh.read(8)


def _decode(img: Image.Image) -> None:
    """Decode every pixel and convert to RGB, the way training will.

    ``LOAD_TRUNCATED_IMAGES`` stays off, so a truncated file fails here.
    """
    img.load()
    if img.mode != "RGB":
        to_rgb(img)


def _not_image_detail(suffix: str) -> str:
    if suffix.lower() in ARCHIVE_SUFFIXES:
        return f"archives inside the input ({suffix}) are not unpacked"
    return f"extension {suffix or '(none)'!r} is not one of {', '.join(IMAGE_EXTENSIONS)}"


class _SourceError(Exception):
    """Reading the source failed (the image's fault), unlike writing the copy (the machine's)."""


def check_file(job: CheckJob) -> CheckResult:
    """Check ``job.source``; copy the bytes that were checked to ``job.target`` when it passes.

    Writing the very bytes that were hashed and decoded means the copy is exactly what the
    manifest describes, even if the source changes meanwhile. Errors writing the copy (a full
    disk) are raised, not skipped: they are the machine's fault, not the image's.
    """
    try:
        size = os.stat(job.source).st_size
    except OSError as exc:
        return CheckResult(job.rel, reason=SkipReason.UNREADABLE_IMAGE.because(str(exc)))
    refused = refused_unread(job.rel, size, job.max_pixels)
    if refused:
        return CheckResult(job.rel, reason=refused, size=size)
    try:
        fh = open(job.source, "rb")  # noqa: SIM115 (closed below)
    except OSError as exc:
        return CheckResult(job.rel, reason=SkipReason.UNREADABLE_IMAGE.because(str(exc)))
    with fh:
        try:
            data = _read(fh, IN_MEMORY_BYTES + 1)
            if len(data) > IN_MEMORY_BYTES:
                return _check_streamed(job, fh, data)
        except _SourceError as exc:
            return CheckResult(job.rel, reason=SkipReason.UNREADABLE_IMAGE.because(str(exc)))
    digest = hashlib.sha256(data).hexdigest()
    try:
        width, height = job.check(data)
    except ImageRefused as refused_image:
        return CheckResult(job.rel, digest, reason=refused_image.reason, size=len(data))
    try:
        fh = open(job.target, "xb")  # noqa: SIM115 (closed below)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(job.target), exist_ok=True)
        fh = open(job.target, "xb")  # noqa: SIM115
    with fh:
        fh.write(data)
    return CheckResult(job.rel, digest, width, height, size=len(data))


def _read(fh: io.BufferedReader, n: int) -> bytes:
    try:
        return fh.read(n)
    except OSError as exc:
        raise _SourceError(str(exc)) from exc


def _check_streamed(job: CheckJob, fh: io.BufferedReader, head: bytes) -> CheckResult:
    """:func:`check_file` for a big file: hashed while it is copied to a scratch file, a chunk at
    a time, then checked from that copy, which becomes the target when it passes.

    A file that grows past :func:`max_file_bytes` while it is read is refused there.
    """
    limit = max_file_bytes(job.max_pixels)
    digest = hashlib.sha256()
    size = 0
    fd, scratch = tempfile.mkstemp(prefix=".checking-", dir=job.scratch)
    try:
        with os.fdopen(fd, "wb") as out:
            chunk = head
            while chunk:
                digest.update(chunk)
                size += len(chunk)
                if size > limit:
                    reason = file_over_limit(size, job.max_pixels) or ""
                    return CheckResult(job.rel, digest.hexdigest(), reason=reason, size=size)
                out.write(chunk)
                chunk = _read(fh, _CHUNK)
        try:
            width, height = job.check(scratch)
        except ImageRefused as refused:
            return CheckResult(job.rel, digest.hexdigest(), reason=refused.reason, size=size)
        os.makedirs(os.path.dirname(job.target), exist_ok=True)
        os.rename(scratch, job.target)  # targets are unique within a conversion
        scratch = ""
        return CheckResult(job.rel, digest.hexdigest(), width, height, size=size)
    finally:
        if scratch:
            os.unlink(scratch)


def check_files(jobs: list[CheckJob]) -> list[CheckResult]:
    """:func:`check_file` on each job: one round trip to a worker process for many files."""
    return [check_file(job) for job in jobs]
