"""The one CSV format of every table imageops writes: RFC 4180 line ends, minimal quoting.

The csv module (which pandas' ``to_csv`` uses too) quotes a field only when it holds the
delimiter, the quote character or a character of its line end. With ``"\\n"`` as the line end a
file or class name holding ``"\\r"`` was written bare, and a reader took it for the end of a row.
With ``"\\r\\n"`` a field holding either is quoted, so every table reads back identically with
``pandas.read_csv`` and the csv module, whatever names it holds.

Pass it to any writer: ``frame.to_csv(path, index=False, **CSV_FORMAT)``,
``csv.writer(fh, **CSV_FORMAT)`` (``fh`` opened with ``newline=""``).
"""

from __future__ import annotations

import csv
from typing import Any

CSV_FORMAT: dict[str, Any] = {"lineterminator": "\r\n", "quoting": csv.QUOTE_MINIMAL}
