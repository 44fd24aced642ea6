"""Ingest checks for one image file: is it what its name says, whole, decodable and not a bomb?

This module runs inside the worker processes of :func:`tasks.convert.convert` (spawned, not
forked), so it imports only Pillow and :mod:`tasks.imageformat` (no pydantic, no Prefect): a
worker starts in a tenth of a second.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import PurePath

from PIL import Image, UnidentifiedImageError

from tasks.imageformat import IMAGE_EXTENSIONS, PIL_FORMATS, SkipReason, to_rgb

DEFAULT_MAX_PIXELS = 40_000_000

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


class ImageRefused(Exception):
    """The file is not a usable image; ``reason`` is the manifest text (``SkipReason: detail``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class CheckJob:
    """One file to check and, when it passes, to copy to ``target`` (bytes exactly as read)."""

    source: str
    rel: str
    target: str
    max_pixels: int


@dataclass(frozen=True)
class CheckResult:
    """What checking found. ``sha256`` and ``size`` describe the bytes read, accepted or not (the
    source's fingerprint covers every file); -1 and "" when the file could not be read."""

    rel: str
    sha256: str = ""
    width: int = 0
    height: int = 0
    reason: str = ""  # empty when the image was accepted and copied
    size: int = -1


def check_image(data: bytes, suffix: str, *, max_pixels: int) -> tuple[int, int]:
    """Width and height of a valid image; raise :class:`ImageRefused` saying why it is not.

    The pixel limit is checked from the header, before any pixel is decoded, so a decompression
    bomb costs a few bytes of reading. Pillow's own global limit is left as it is: its warning is
    silenced for this call only (our limit is the one that counts), and its hard error (twice its
    limit) still refuses anything bigger whatever ``max_pixels`` says.
    """
    if not data:
        raise ImageRefused(SkipReason.EMPTY_FILE.because("the file has zero bytes"))
    allowed = _FORMATS_BY_EXTENSION.get(suffix.lower())
    if allowed is None:
        raise ImageRefused(SkipReason.NOT_AN_IMAGE.because(_not_image_detail(suffix)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=PIL_FORMATS) as img:
                width, height = img.size
                if width * height > max_pixels:
                    raise ImageRefused(
                        SkipReason.IMAGE_EXCEEDS_LIMIT.because(
                            f"{width}x{height} = {width * height:,} pixels is over the limit of "
                            f"{max_pixels:,} (raise max_pixels if this image is genuine)"
                        )
                    )
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
                with Image.open(io.BytesIO(data), formats=["PNG"]) as img:
                    _decode(img)
    except ImageRefused:
        raise
    except Image.DecompressionBombError as exc:
        # Pillow's hard limit struck first (while reading the header): report it as ours, the
        # limit the user can change, unless max_pixels is above Pillow's.
        found = re.search(r"\((\d+) pixels\)", str(exc))
        if found is None or int(found[1]) <= max_pixels:
            raise ImageRefused(SkipReason.IMAGE_EXCEEDS_LIMIT.because(str(exc))) from exc
        raise ImageRefused(
            SkipReason.IMAGE_EXCEEDS_LIMIT.because(
                f"{int(found[1]):,} pixels is over the limit of {max_pixels:,} (raise max_pixels "
                "if this image is genuine)"
            )
        ) from exc
    except UnidentifiedImageError as exc:
        if data.startswith(_MAGIC):
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


def check_file(job: CheckJob) -> CheckResult:
    """Check ``job.source``; copy the bytes that were checked to ``job.target`` when it passes.

    Writing the very bytes that were hashed and decoded means the copy is exactly what the
    manifest describes, even if the source changes meanwhile. Errors writing the copy (a full
    disk) are raised, not skipped: they are the machine's fault, not the image's.
    """
    try:
        with open(job.source, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        return CheckResult(job.rel, reason=SkipReason.UNREADABLE_IMAGE.because(str(exc)))
    digest = hashlib.sha256(data).hexdigest()
    try:
        width, height = check_image(data, PurePath(job.rel).suffix, max_pixels=job.max_pixels)
    except ImageRefused as refused:
        return CheckResult(job.rel, digest, reason=refused.reason, size=len(data))
    try:
        fh = open(job.target, "xb")  # noqa: SIM115 (closed below)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(job.target), exist_ok=True)
        fh = open(job.target, "xb")  # noqa: SIM115
    with fh:
        fh.write(data)
    return CheckResult(job.rel, digest, width, height, size=len(data))


def check_files(jobs: list[CheckJob]) -> list[CheckResult]:
    """:func:`check_file` on each job: one round trip to a worker process for many files."""
    return [check_file(job) for job in jobs]
