"""The error every imageops failure derives from, and the model-directory error of the Azure design.

Each error carries the problem and what to do about it, so the CLI prints both and never a bare
traceback. Dataset and training errors live in ``tasks/shared/errors.py``; this one is here because
the model zoo (which knows nothing of Prefect or datasets) raises it.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path


class ImageOpsError(Exception):
    """A failure the user can fix: ``str(err)`` says what was wrong, ``err.hint`` what to do.

    ``retryable`` is False for bad input (trying again cannot help, so Prefect fails the task at
    once) and True for failures a second attempt may get past (a crashed worker, a timeout).
    """

    retryable: bool = False

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} {self.hint}".strip()

    def __reduce__(self):  # keep message and hint across process boundaries (Prefect, torchrun)
        return (self.__class__, (self.message, self.hint))


class InvalidModelDirectoryError(ImageOpsError):
    """Azure error: the untrained or trained model input is no PyTorch model directory we know."""


class InvalidParameterError(ImageOpsError):
    """A parameter is out of its range; raised before any work starts.

    Here, not in ``tasks/shared/errors.py`` (which re-exports it), because the atomic writer
    refuses a destination it must not replace.
    """


class DiskFullError(ImageOpsError):
    """A disk filled up (or a quota ran out) while a step wrote its output.

    Not retried: a second attempt seconds later meets the same full disk. Here, beside the base
    class, because training workers (which import little) report it too.
    """


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# Less free than this: a failure that did not say why (a worker that could not write its
# record, DVC's "files failed to upload") is taken for the full disk's.
FULL_DISK_BYTES = 1 << 20


def disk_full(exc: BaseException) -> DiskFullError | None:
    """``exc`` as a DiskFullError when it is (or was caused by) a full disk, else None."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, DiskFullError):
            return seen
        if isinstance(seen, OSError) and seen.errno in DISK_FULL_ERRNOS:
            where = seen.filename or "the output"
            return no_space_left(f"the disk holding {where} ({seen.strerror})")
        if "No space left on device" in str(seen):  # libraries that drop the errno (DVC, torch)
            return no_space_left(f"the disk: {str(seen)[:300]}")
        seen = seen.__cause__ or seen.__context__
    return None


def full_disk_at(what: str, path: Path) -> DiskFullError | None:
    """A DiskFullError naming ``what`` at ``path`` when its disk has (almost) no space left."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return None
    if free >= FULL_DISK_BYTES:
        return None
    return no_space_left(f"the disk holding {what} {path} ({free:,} bytes free)")


def no_space_left(where: str) -> DiskFullError:
    """The DiskFullError for ``where`` ("the disk holding /data/out (...)")."""
    return DiskFullError(
        f"no space left on {where}.",
        "Free space on that disk (or write to another: the output folder, IMAGEOPS_HOME), then "
        "run the same command again; nothing half-written is kept.",
    )
