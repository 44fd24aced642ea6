"""A log file's last lines, or one start's part of it: what a failed process said, and only
that start's lines (an appended log holds earlier starts too)."""

from __future__ import annotations

from pathlib import Path

TAIL_LINES = 25


def tail(path: Path | None, lines: int = TAIL_LINES, offset: int = 0) -> str:
    """The last ``lines`` lines of ``path`` from byte ``offset`` on ("" when there is no file)."""
    if path is None:
        return ""
    return "\n".join(read_from(Path(path), offset).splitlines()[-lines:])


def read_from(path: Path, offset: int) -> str:
    """The text of ``path`` from byte ``offset`` on: this launch's part of an appended log."""
    if not path.is_file():
        return ""
    with open(path, "rb") as handle:
        handle.seek(offset)
        return handle.read().decode("utf-8", errors="replace")
