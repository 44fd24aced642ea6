"""Convert to Image Directory: a folder, an archive or a label file becomes an ImageDirectory.

Class sub-folders are labels; a folder with images directly in it is unlabeled (for scoring).
Archives (.zip, .tar, .tar.gz/.tgz, .tar.bz2) are extracted safely first (see
:mod:`tasks.data.archive`); a single folder wrapping everything in an archive is unwrapped, so zipping a
folder converts exactly like the folder. A CSV manifest (``path,label``) or a COCO classification
JSON names the images and their labels instead (see :mod:`tasks.data.labelfiles`); each image is copied
to ``<class>/<its file name>``, a name taken already gets ``_1``, ``_2``... Every file is opened,
checked against its extension, verified and fully decoded, in parallel on all cores; the ones that
fail are skipped and listed in the manifest with the reason, and the good ones are copied byte for
byte with their sha256 and size recorded. Identical images are kept but listed, since they leak
between a training and a validation split. Converting again is a cache hit when nothing changed.

One module per job: :mod:`.sources` (what can be read: one class per input, the extension
point), :mod:`.folders` and :mod:`.plan` (what to convert), :mod:`.checking` (the process pool),
:mod:`.cache`, :mod:`.report`, and :mod:`.run` (the steps in order).
"""

from tasks.data.convert.checking import MIN_BYTES_FOR_POOL, MIN_FILES_FOR_POOL
from tasks.data.convert.limits import ConvertLimits
from tasks.data.convert.plan import ConversionPlan, PlannedFile
from tasks.data.convert.run import convert, convert_task, source_classes
from tasks.data.convert.sources import (
    INPUT_SOURCES,
    InputSource,
    LabelFileSource,
    find_source,
    register_source,
)

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
