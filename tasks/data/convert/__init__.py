"""Convert to Image Directory: a folder, an archive or a label file becomes an ImageDirectory.

Class sub-folders are labels (none: unlabeled, for scoring); archives are extracted safely
(:mod:`tasks.data.archive`), label files name images and labels (:mod:`tasks.data.labelfiles`).
Every file is checked and fully decoded in parallel; failures are skipped and listed, duplicates
listed, and converting again is a cache hit. One module per job: ``sources`` (the extension point),
``folders``, ``plan``, ``limits``, ``checking``, ``cache``, ``report``, ``run``.
Details: docs/convert.md#convert-to-image-directory.
"""

from tasks.data.convert.checking import MIN_BYTES_FOR_POOL, MIN_FILES_FOR_POOL
from tasks.data.convert.limits import ConvertLimits
from tasks.data.convert.plan import ConversionPlan, PlannedFile
from tasks.data.convert.run import convert, source_classes
from tasks.data.convert.sources import (
    INPUT_SOURCES,
    InputSource,
    LabelFileSource,
    find_source,
    register_source,
)


def __getattr__(name: str) -> object:
    """``convert_task``: made (and Prefect imported) only when a flow asks for it."""
    if name == "convert_task":
        from tasks.data.convert import run

        return run.convert_task
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "INPUT_SOURCES",
    "MIN_BYTES_FOR_POOL",
    "MIN_FILES_FOR_POOL",
    "ConversionPlan",
    "ConvertLimits",
    "InputSource",
    "LabelFileSource",
    "PlannedFile",
    "convert",
    "convert_task",
    "find_source",
    "register_source",
    "source_classes",
]
