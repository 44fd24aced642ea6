"""Every error a user can meet, in one import: ``from tasks.errors import ...``.

The three seed errors keep the seed's names (Train PyTorch Model raises them where the Azure
component does); the others name the step that refused the input.
"""

from __future__ import annotations

from models.errors import ImageOpsError, InvalidModelDirectoryError

__all__ = [
    "ExportParityError",
    "ImageOpsError",
    "InvalidDatasetError",
    "InvalidImageDirectoryError",
    "InvalidModelDirectoryError",
    "InvalidParameterError",
    "NoUsableImagesError",
    "NotLabeledDatasetError",
    "RegistryError",
    "TrainingDivergedError",
    "TrainingFailedError",
    "UnsafeArchiveError",
    "VersioningError",
]


class NotLabeledDatasetError(ImageOpsError):
    """Seed error: training (or evaluation) needs a labeled image directory."""


class InvalidDatasetError(ImageOpsError):
    """Seed error: training and validation data do not have the same label categories."""


class InvalidImageDirectoryError(ImageOpsError):
    """A folder given as an ImageDirectory has no valid manifest.json (run `imageops convert`)."""


class NoUsableImagesError(ImageOpsError):
    """Conversion found no image it could decode: nothing to write."""


class UnsafeArchiveError(ImageOpsError):
    """An archive member would land outside the destination or is not a plain file."""


class InvalidParameterError(ImageOpsError):
    """A parameter is out of its range; raised before any work starts."""


class TrainingFailedError(ImageOpsError):
    """torchrun ended with an error; the message points at the rank logs. Worth a retry."""

    retryable = True


class TrainingDivergedError(ImageOpsError):
    """The training loss became NaN or infinite: the parameters, not luck, must change."""


class ExportParityError(ImageOpsError):
    """The ONNX model does not give the same answers as the PyTorch model."""


class RegistryError(ImageOpsError):
    """A registered model, version or alias is missing or cannot be written."""


class VersioningError(ImageOpsError):
    """DVC could not version a data set."""
