"""The error every imageops failure derives from, and the model-directory error of the Azure design.

Each error carries the problem and what to do about it, so the CLI prints both and never a bare
traceback. Dataset and training errors live in ``tasks/shared/errors.py``; this one is here because
the model zoo (which knows nothing of Prefect or datasets) raises it.
"""

from __future__ import annotations


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
