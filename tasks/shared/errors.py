"""Every error a user can meet, in one import: ``from tasks.shared.errors import ...``.

The Azure design's errors keep their names (raised where the Azure components raise them: Train
PyTorch Model, Apply Image Transformation); the others name the step that refused the input.
"""

from __future__ import annotations

from models.errors import (
    DiskFullError,
    ImageOpsError,
    InvalidModelDirectoryError,
    InvalidParameterError,
    disk_full,
)
from tasks.shared.settings import redact_uri

__all__ = [
    "ClusterUnavailableError",
    "DataUnavailableError",
    "DatasetBusyError",
    "DiskFullError",
    "ExportParityError",
    "ImageOpsError",
    "InvalidDatasetError",
    "InvalidImageDirectoryError",
    "InvalidLabelFileError",
    "InvalidModelDirectoryError",
    "InvalidParameterError",
    "InvalidTransformationDirectoryError",
    "InvalidTuningSpecError",
    "NoUsableImagesError",
    "NotLabeledDatasetError",
    "ObjectStoreError",
    "QuantizationAccuracyError",
    "RegistryError",
    "RendezvousTimeoutError",
    "ScoringFailedError",
    "StateFolderError",
    "TeamAuthError",
    "TeamJoinFileError",
    "TeamStackError",
    "TeamUnreachableError",
    "TrainingDivergedError",
    "TrainingFailedError",
    "TuningFailedError",
    "UnregisteredCodeError",
    "UnsafeArchiveError",
    "VersionMismatchError",
    "VersioningError",
    "disk_full",
    "error_summary",
    "error_text",
]


def error_summary(exc: ImageOpsError) -> tuple[str, str]:
    """What a command prints for a user error: ``(problem, what to do)``, passwords masked.

    The problem starts with the error's class name: the Azure docs (and a search) know an error
    by that name, e.g. ``InvalidModelDirectoryError: data/x is not a model directory: ...``.
    """
    return f"{type(exc).__name__}: {redact_uri(exc.message)}", redact_uri(exc.hint)


def error_text(exc: ImageOpsError) -> str:
    """The ``error:`` and ``what to do:`` lines as plain text, for the ``python -m`` entries."""
    problem, hint = error_summary(exc)
    return f"error: {problem}" + (f"\nwhat to do: {hint}" if hint else "")


class NotLabeledDatasetError(ImageOpsError):
    """Azure error: training (or evaluation) needs a labeled image directory."""


class InvalidDatasetError(ImageOpsError):
    """Azure error: training and validation data do not have the same label categories."""


class InvalidImageDirectoryError(ImageOpsError):
    """A folder given as an ImageDirectory has no valid manifest.json (run `imageops convert`)."""


class InvalidTransformationDirectoryError(ImageOpsError):
    """Azure error: not a transform spec Init Image Transformation wrote, or one no network can use.

    Raised for a missing or unreadable ``transform.json``, a value out of range in it, and a spec
    whose training and inference transforms would feed the network images of different sizes.
    """


class InvalidLabelFileError(ImageOpsError):
    """A CSV manifest or COCO JSON given to Convert is malformed.

    The message names the line (CSV) or the field (JSON) and what is wrong with it.
    """


class NoUsableImagesError(ImageOpsError):
    """Conversion found no image it could decode: nothing to write."""


class UnsafeArchiveError(ImageOpsError):
    """An archive member would land outside the destination or is not a plain file."""


class ScoringFailedError(ImageOpsError):
    """ONNX Runtime could not score a batch: the model failed at run time (e.g. asked for more
    memory than there is), returned scores of the wrong shape, or ran past the per-batch time
    limit (``IMAGEOPS_SCORE_BATCH_TIMEOUT_S``). Not retryable: the same model fails the same way.
    """


class TrainingFailedError(ImageOpsError):
    """torchrun ended with an error; the message points at the rank logs. Worth a retry."""

    retryable = True


class RendezvousTimeoutError(ImageOpsError):
    """Not every node of a cluster training job came to the rendezvous in time.

    Not retryable: the rendezvous timeout already is the wait for late nodes; a node that cannot
    reach the endpoint will not reach it on a retry either.
    """


class ClusterUnavailableError(ImageOpsError):
    """The Ray cluster did not answer at its address, or did not offer the nodes asked for.

    Not retryable by Prefect: the wait for the cluster (``cluster_timeout_s``) already is the
    patience the user chose.
    """


class TrainingDivergedError(ImageOpsError):
    """The training loss became NaN or infinite: the parameters, not luck, must change."""


class ExportParityError(ImageOpsError):
    """The ONNX model does not give the same answers as the PyTorch model."""


class QuantizationAccuracyError(ImageOpsError):
    """The INT8 model loses more validation top-1 than ``max_top1_drop`` allows; none is kept."""


class RegistryError(ImageOpsError):
    """A registered model, version or alias is missing or cannot be written."""


class RegistryUnreachableError(RegistryError):
    """The MLflow registry did not answer or failed; a later attempt may get through."""

    retryable = True


class VersioningError(ImageOpsError):
    """DVC could not version a data set."""


class VersionMismatchError(VersioningError):
    """A folder to version whose files are not the ones its manifest.json lists (it changed while
    it was added, or by hand): nothing was recorded or pushed. The message gives both counts."""


class ObjectStoreError(ImageOpsError):
    """The S3 object store did not start, or refused or did not answer a request.

    The message names the endpoint or the ``s3://`` URL, never a secret key.
    """


class DataUnavailableError(ImageOpsError):
    """A data set version (by md5) could not be had on this machine: the DVC remote does not hold
    it, or could not be reached. The message names the md5, the remote and this host."""


class DatasetBusyError(ImageOpsError):
    """Another pipeline run has been preparing the same data set, or another step writing or
    versioning the same data set folder, for longer than the wait allows."""


class InvalidTuningSpecError(InvalidParameterError):
    """A tuning spec that cannot make a study; refused before any trial runs.

    The message names the parameter and what is wrong with it: a grid over a double, a log
    scale with min <= 0, a child whose parent is missing or a double, an unknown training
    parameter, or a study that was started with another search space.
    """


class TuningFailedError(ImageOpsError):
    """A tuning study stopped: more trials failed than ``max_failed_trial_count`` allows, or no
    trial completed. The message gives the count and the last trial's error."""


class StateFolderError(ImageOpsError):
    """A folder that is to hold a stack's state (databases, volumes, Ray sessions) is another
    user's, or not a folder: the servers would keep their state where others can reach it."""


class TeamStackError(ImageOpsError):
    """The team stack (``imageops team server`` / ``join``) could not start or join."""


class TeamJoinFileError(TeamStackError):
    """The join file is missing, unreadable, readable by others, or lacks a variable."""


class TeamUnreachableError(TeamStackError):
    """A server of the team stack does not answer: the message names which one and where."""


class TeamAuthError(TeamStackError):
    """A server of the team stack refused the join file's credentials (which server, where)."""


class UnregisteredCodeError(ImageOpsError):
    """A worker refused a flow run whose pool template, deployment (entrypoint, pull steps, job
    variables) or job variables differ from what the project registered: nothing of it ran."""
