"""The scored tables' file formats, one class per file suffix, and the one CSV format.

:data:`TABLE_FORMATS` maps a suffix to a :class:`TableFormat` (write in batches, concatenate
shards, read back): a new format is a subclass and a line there. :data:`CSV_FORMAT` (RFC 4180
``"\\r\\n"`` line ends) quotes names holding ``"\\r"``, so every table reads back identically.
Details: docs/internals.md#table-formats.
"""

from __future__ import annotations

import csv
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from models.errors import InvalidParameterError

CSV_FORMAT: dict[str, Any] = {"lineterminator": "\r\n", "quoting": csv.QUOTE_MINIMAL}
ROW_GROUP_ROWS = 16_384  # Parquet: rows buffered into one row group (tiny groups read slowly)


class TableWriter:
    """Appends batches of rows to one table file; :meth:`close` completes it."""

    def write(self, frame: pd.DataFrame) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class TableFormat:
    """How the tables of one file suffix are written, concatenated and read."""

    suffix = ""

    def writer(self, path: Path, schema: pa.Schema) -> TableWriter:
        """A writer of a new table at ``path`` with ``schema``'s columns, in its order."""
        raise NotImplementedError

    def concatenate(self, parts: Sequence[Path], dest: Path) -> None:
        """Write the tables ``parts`` one after another into ``dest``, streaming."""
        raise NotImplementedError

    def read(
        self, path: Path, text: Sequence[str], columns: Sequence[str] | None = None
    ) -> pd.DataFrame:
        """The table at ``path`` (only ``columns`` when given); the ``text`` columns as strings,
        empty cells as ``""`` (a class "1" must not become the number 1)."""
        raise NotImplementedError

    def read_chunks(
        self, path: Path, text: Sequence[str], rows: int, leave_out: Sequence[str] = ()
    ) -> Iterator[pd.DataFrame]:
        """:meth:`read` ``rows`` rows at a time, without the columns ``leave_out``: memory follows
        ``rows``, not the table. At least one frame, empty for a table of no rows. This default,
        for a format that cannot read in pieces, reads the whole table."""
        table = self.read(path, text)
        yield table.drop(columns=[c for c in leave_out if c in table.columns])


class _CsvWriter(TableWriter):
    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self._file: IO[str] = open(path, "w", encoding="utf-8", newline="")  # noqa: SIM115
        pd.DataFrame(columns=schema.names).to_csv(self._file, index=False, **CSV_FORMAT)

    def write(self, frame: pd.DataFrame) -> None:
        frame.to_csv(self._file, header=False, index=False, **CSV_FORMAT)

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


class CsvTable(TableFormat):
    suffix = ".csv"

    def writer(self, path: Path, schema: pa.Schema) -> TableWriter:
        return _CsvWriter(path, schema)

    def concatenate(self, parts: Sequence[Path], dest: Path) -> None:
        with open(dest, "w", encoding="utf-8", newline="") as out:
            for i, part in enumerate(parts):
                with open(part, encoding="utf-8", newline="") as src:
                    header = src.readline()
                    if i == 0:
                        out.write(header)
                    shutil.copyfileobj(src, out)

    def read(
        self, path: Path, text: Sequence[str], columns: Sequence[str] | None = None
    ) -> pd.DataFrame:
        return pd.read_csv(
            path,
            usecols=None if columns is None else list(columns),
            dtype=dict.fromkeys(text, str),
            keep_default_na=False,
        )

    def read_chunks(
        self, path: Path, text: Sequence[str], rows: int, leave_out: Sequence[str] = ()
    ) -> Iterator[pd.DataFrame]:
        skipped = set(leave_out)
        with pd.read_csv(
            path,
            usecols=lambda column: column not in skipped,
            dtype=dict.fromkeys(text, str),
            keep_default_na=False,
            chunksize=rows,
        ) as chunks:
            yield from chunks  # a table of no rows is one empty chunk


class _ParquetWriter(TableWriter):
    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self._schema = schema
        self._file = pq.ParquetWriter(str(path), schema)
        self._pending: list[pd.DataFrame] = []

    def write(self, frame: pd.DataFrame) -> None:
        self._pending.append(frame)
        if sum(len(f) for f in self._pending) >= ROW_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            frame = pd.concat(self._pending, ignore_index=True)
            self._pending = []
            table = pa.Table.from_pandas(frame, schema=self._schema, preserve_index=False)
            self._file.write_table(table)

    def close(self) -> None:
        self._flush()
        self._file.close()


class ParquetTable(TableFormat):
    suffix = ".parquet"

    def writer(self, path: Path, schema: pa.Schema) -> TableWriter:
        return _ParquetWriter(path, schema)

    def concatenate(self, parts: Sequence[Path], dest: Path) -> None:
        writer = None
        try:
            for part in parts:  # a row group at a time
                source = pq.ParquetFile(part)
                writer = writer or pq.ParquetWriter(str(dest), source.schema_arrow)
                for group in range(source.num_row_groups):
                    writer.write_table(source.read_row_group(group))
        finally:
            if writer is not None:
                writer.close()

    def read(
        self, path: Path, text: Sequence[str], columns: Sequence[str] | None = None
    ) -> pd.DataFrame:
        return pd.read_parquet(path, columns=None if columns is None else list(columns))

    def read_chunks(
        self, path: Path, text: Sequence[str], rows: int, leave_out: Sequence[str] = ()
    ) -> Iterator[pd.DataFrame]:
        source = pq.ParquetFile(path)
        columns = [name for name in source.schema_arrow.names if name not in set(leave_out)]
        empty = True
        for batch in source.iter_batches(batch_size=rows, columns=columns):
            empty = False
            yield batch.to_pandas()
        if empty:
            yield source.schema_arrow.empty_table().select(columns).to_pandas()


# One entry per format; the suffix of a table's name picks it.
TABLE_FORMATS: dict[str, TableFormat] = {f.suffix: f for f in (CsvTable(), ParquetTable())}


def table_format(path: Path, what: str = "table") -> TableFormat:
    """The format of the table named ``path``; InvalidParameterError for another suffix."""
    found = TABLE_FORMATS.get(Path(path).suffix.lower())
    if found is None:
        suffixes = " or ".join(TABLE_FORMATS)
        raise InvalidParameterError(
            f"The {what} must end in {suffixes}, got {Path(path).name!r}.",
            f"Name it like scores{next(iter(TABLE_FORMATS))} (one of {suffixes}).",
        )
    return found
