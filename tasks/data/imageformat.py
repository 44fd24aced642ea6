"""What imageops reads as an image, how it becomes RGB, and why a file is left out.

Part of the ImageDirectory contract (:mod:`tasks.data.imagedir` re-exports it), kept apart so
convert's workers import Pillow only and start fast. The image limits live here, once, for every
step that decodes a file: pixels, aspect ratio and file size, checked from the header before a
pixel is decoded. Details: docs/images.md#image-formats-and-limits.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from enum import StrEnum
from pathlib import Path

from PIL import (  # the decoders of PIL_FORMATS, registered with Pillow at import
    BmpImagePlugin,  # noqa: F401
    Image,
    JpegImagePlugin,  # noqa: F401
    PngImagePlugin,  # noqa: F401
    PpmImagePlugin,  # noqa: F401
    TiffImagePlugin,  # noqa: F401
    WebPImagePlugin,  # noqa: F401
)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# Pillow format names we open; anything else is refused even if the extension looks right. Their
# plugins are imported above: opening with a format Pillow has not loaded imports every plugin
# it has (0.24 s, PDF's alone 0.17 s), on the first image of every new reader or loader process.
PIL_FORMATS = ("JPEG", "PNG", "PPM", "BMP", "TIFF", "WEBP")


def _limit(variable: str, default: int) -> int:
    """A limit from the environment, so every step and every worker process reads the same one."""
    value = os.environ.get(variable, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{variable} = {value!r}, expected a whole number of 1 or more.")
    return int(value)


# The decoded-size limits of every step that reads images (convert, transform, train, score,
# export): width x height, and the longer side over the shorter. Environment variables raise
# them for genuine giants; convert's ``max_pixels``/``max_aspect_ratio`` default to them.
MAX_PIXELS = _limit("IMAGEOPS_MAX_PIXELS", 40_000_000)
MAX_ASPECT_RATIO = _limit("IMAGEOPS_MAX_ASPECT_RATIO", 100)
# The most bytes one pixel takes in any format we read (16-bit RGBA, uncompressed), and room for
# metadata (EXIF, ICC profiles, XMP, thumbnails) on top.
_BYTES_PER_PIXEL = 8
_METADATA_BYTES = 16 * 1024**2


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
    # Entries of a CSV manifest or COCO JSON:
    UNSAFE_PATH = "UnsafePath"
    MISSING_FILE = "MissingFile"
    MISSING_LABEL = "MissingLabel"
    BAD_LABEL = "BadLabel"
    MULTIPLE_LABELS = "MultipleLabels"
    UNKNOWN_CATEGORY = "UnknownCategory"
    DUPLICATE_ENTRY = "DuplicateEntry"

    def because(self, detail: str) -> str:
        """The reason text: code first, then what exactly was wrong."""
        return f"{self.value}: {detail}"


def is_utf8(name: str) -> bool:
    """Whether ``name`` is text that UTF-8 (and so JSON, a manifest, a table) can hold: not a
    file name read with ``surrogateescape`` from bytes that are not UTF-8."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def printable_name(name: str) -> str:
    """``name`` as a report shows it: unchanged when it is text, else with ``\\xNN`` escapes.

    Python reads a file name that is not UTF-8 with each odd byte as a lone surrogate
    (``surrogateescape``); neither JSON readers nor UTF-8 tables take those, so each shows as the
    byte it stands for. A report names the file; it cannot be used to open it.
    """
    if is_utf8(name):
        return name
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that is no escaped byte (JSON's "\\ud800")
        return name.encode("utf-8", "backslashreplace").decode("utf-8")


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def visible_name(name: str) -> str:
    """``name`` with its control characters as escapes (``\\r``, ``\\x1b``), for a terminal or a
    plot: a file name may hold any of them, and shown as they are they move the cursor, talk to
    the terminal, or draw nothing."""
    return _CONTROL.sub(lambda match: repr(match.group())[1:-1], name)


class ImageRefused(Exception):
    """The file is not a usable image; ``reason`` is the manifest text (``SkipReason: detail``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def is_image_file(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS


def max_file_bytes(max_pixels: int = MAX_PIXELS) -> int:
    """The largest file an image of at most ``max_pixels`` pixels may be: 8 bytes a pixel (an
    uncompressed 16-bit RGBA image) plus 16 MiB of metadata. A bigger file is refused unread."""
    return _BYTES_PER_PIXEL * max_pixels + _METADATA_BYTES


def file_over_limit(size: int, max_pixels: int = MAX_PIXELS) -> str | None:
    """The ``ImageExceedsLimit`` reason for a file of ``size`` bytes; None: it may be read."""
    if size <= max_file_bytes(max_pixels):
        return None
    return SkipReason.IMAGE_EXCEEDS_LIMIT.because(
        f"the file is {size:,} bytes, more than an image within the limit of {max_pixels:,} "
        f"pixels can take ({max_file_bytes(max_pixels):,}); it is not read"
    )


def size_over_limit(
    width: int,
    height: int,
    max_pixels: int = MAX_PIXELS,
    max_aspect_ratio: int = MAX_ASPECT_RATIO,
) -> str | None:
    """The ``ImageExceedsLimit`` reason for a ``width`` x ``height`` image, or None within limits.

    From the header, so a bomb costs a few bytes of reading.
    """
    if width * height > max_pixels:
        return SkipReason.IMAGE_EXCEEDS_LIMIT.because(
            f"{width}x{height} = {width * height:,} pixels is over the limit of {max_pixels:,} "
            "(set IMAGEOPS_MAX_PIXELS higher if this image is genuine)"
        )
    long, short = max(width, height), min(width, height)
    if long > max_aspect_ratio * short:
        ratio = f"{long / short:,.0f}:1" if short else "infinite"
        return SkipReason.IMAGE_EXCEEDS_LIMIT.because(
            f"{width}x{height} has an aspect ratio of {ratio}, over the limit of "
            f"{max_aspect_ratio:,}:1 (set IMAGEOPS_MAX_ASPECT_RATIO higher if this image is "
            "genuine)"
        )
    return None


def bomb_refused(exc: Image.DecompressionBombError, max_pixels: int) -> ImageRefused:
    """Pillow's own hard limit (twice ``Image.MAX_IMAGE_PIXELS``) struck while reading a header:
    reported as ours, the limit the user can change, unless ``max_pixels`` is above Pillow's."""
    found = re.search(r"\((\d+) pixels\)", str(exc))
    if found is None or int(found[1]) <= max_pixels:
        return ImageRefused(SkipReason.IMAGE_EXCEEDS_LIMIT.because(str(exc)))
    return ImageRefused(
        SkipReason.IMAGE_EXCEEDS_LIMIT.because(
            f"{int(found[1]):,} pixels is over the limit of {max_pixels:,} (set "
            "IMAGEOPS_MAX_PIXELS higher if this image is genuine)"
        )
    )


def load_rgb(
    path: Path | io.BytesIO,
    *,
    max_pixels: int = MAX_PIXELS,
    max_aspect_ratio: int = MAX_ASPECT_RATIO,
) -> Image.Image:
    """Open an image (a file, or an object's bytes fetched from S3) as 8-bit RGB, whatever its
    mode (gray, palette, RGBA, CMYK, 16-bit).

    Raises :class:`ImageRefused` (reason ``ImageExceedsLimit``) for a file or an image over the
    limits convert applies, checked from the file's size and its header before anything is
    decoded, so a hostile file costs a few bytes of reading, never gigabytes of memory.
    """
    size = path.getbuffer().nbytes if isinstance(path, io.BytesIO) else os.stat(path).st_size
    refused = file_over_limit(size, max_pixels)
    if refused:
        raise ImageRefused(refused)
    with warnings.catch_warnings():
        # Our limit is the one that counts; Pillow's hard error (twice its own) is mapped to it.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(path, formats=PIL_FORMATS) as img:
                refused = size_over_limit(*img.size, max_pixels, max_aspect_ratio)
                if refused:
                    raise ImageRefused(refused)
                img.load()
                return to_rgb(img)
        except Image.DecompressionBombError as exc:
            raise bomb_refused(exc, max_pixels) from exc


def to_rgb(img: Image.Image) -> Image.Image:
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        # 16/32-bit integer gray: scale to 8 bits instead of letting convert() clip at 255.
        import numpy as np

        arr = np.asarray(img, dtype=np.float64)
        top = 65535.0 if img.mode.startswith("I;16") else max(float(arr.max()), 1.0)
        # Rounded, so 65535 -> 255 and 32768 -> 128, as a right shift by 8 would give.
        img = Image.fromarray(np.rint(arr * (255.0 / top)).clip(0, 255).astype(np.uint8))
    elif (img.mode == "P" and "transparency" in img.info) or img.mode == "PA":
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA"):
        background = Image.new("RGB", img.size, (255, 255, 255))
        background.paste(img, mask=img.getchannel("A"))
        return background
    return img.convert("RGB")
