"""What imageops reads as an image, how it becomes RGB, and why a file is left out.

Part of the ImageDirectory contract (:mod:`tasks.imagedir` re-exports every name here), kept apart
because it needs Pillow only: convert's worker processes import it, and a worker that does not
import pydantic starts several times faster.
"""

from __future__ import annotations

import re
import warnings
from enum import StrEnum
from pathlib import Path

from PIL import Image

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


def is_image_file(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS


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
        # Rounded, so 65535 -> 255 and 32768 -> 128, as a right shift by 8 would give.
        img = Image.fromarray(np.rint(arr * (255.0 / top)).clip(0, 255).astype(np.uint8))
    elif (img.mode == "P" and "transparency" in img.info) or img.mode == "PA":
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA"):
        background = Image.new("RGB", img.size, (255, 255, 255))
        background.paste(img, mask=img.getchannel("A"))
        return background
    return img.convert("RGB")
