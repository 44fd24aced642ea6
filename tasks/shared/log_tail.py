"""The last lines of a log file, for error messages that say what a failed process said last."""

from __future__ import annotations

from pathlib import Path

TAIL_LINES = 25


def tail(path: Path | None, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of ``path`` ("" when there is no such file)."""
    if path is None or not Path(path).is_file():
        return ""
    return "\n".join(Path(path).read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
