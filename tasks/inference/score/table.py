"""The Score Image Model table: its columns, and the merge of shard tables into one.

``id`` (the image's place in the listing), ``path``, ``category`` (the true class, only when the
input is labeled), ``Scoring Error``, one ``Scored Probabilities_<class>`` column per class
(softmax), then ``Scored Labels``. The file format (CSV, Parquet, ...) follows the suffix
(:func:`tasks.inference.tables.table_format`); :func:`table_file` writes it here or to S3.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa

from models.atomic import atomic_file
from tasks.inference.tables import table_format
from tasks.shared.errors import NoUsableImagesError
from tasks.shared.object_store import S3Url

PROBABILITY_PREFIX = "Scored Probabilities_"
LABEL_COLUMN = "Scored Labels"
TRUE_LABEL_COLUMN = "category"  # an ImageDirectory's class of the image, when it has one
ERROR_COLUMN = "Scoring Error"  # empty when the image was scored; else why it could not be
# What to do when no row was scored: each row's reason is in the log.
NOT_SCORED_HINT = (
    "The log names each image and why: check the files open in an image viewer; a model that "
    "returned NaN or infinite scores must be trained or exported again."
)


def table_schema(classes: Sequence[str], labeled: bool) -> pa.Schema:
    """The Score Image Model table's columns, in order, with their types."""
    fields = [pa.field("id", pa.int64()), pa.field("path", pa.string())]
    if labeled:
        fields.append(pa.field(TRUE_LABEL_COLUMN, pa.string()))
    fields.append(pa.field(ERROR_COLUMN, pa.string()))
    fields += [pa.field(f"{PROBABILITY_PREFIX}{c}", pa.float64()) for c in classes]
    fields.append(pa.field(LABEL_COLUMN, pa.string()))
    return pa.schema(fields)


def merge_tables(parts: Sequence[Path], dest: Path) -> int:
    """Concatenate the shard tables ``parts`` into ``dest`` in the order given, atomically.

    Streams (a row group or a block of lines at a time), so memory stays flat. Returns how many
    rows were scored (not failed). Raises NoUsableImagesError when none was.
    """
    dest = Path(dest)
    table = table_format(dest, "scored table")
    scored = rows = 0
    with atomic_file(dest) as tmp:
        table.concatenate(parts, tmp)
        for part in parts:
            errors = table.read(part, [ERROR_COLUMN], columns=[ERROR_COLUMN])[ERROR_COLUMN]
            scored += int((errors == "").sum())
            rows += len(errors)
        if not scored:
            raise NoUsableImagesError(
                f"None of the {rows} image(s) could be scored.", NOT_SCORED_HINT
            )
    return scored


@contextlib.contextmanager
def table_file(dest: Path | S3Url) -> Iterator[Path]:
    """Where a scoring writes its table: ``dest`` atomically, or, for an S3 object, a private
    temporary file uploaded whole once written (:func:`tasks.inference.score.s3_table.upload_part`)
    and then removed: an S3 object appears only when its upload completes, so a crash never
    leaves half a part.
    """
    if not isinstance(dest, S3Url):
        with atomic_file(dest) as tmp:
            yield tmp
        return
    from tasks.inference.score.s3_table import upload_part

    fd, name = tempfile.mkstemp(prefix=".imageops-part-", suffix=dest.suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        upload_part(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
