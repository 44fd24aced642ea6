"""How a worker's error crosses the process boundary back to the launcher.

torchrun reports only "a child failed"; the launcher needs to know *which* error, so that a
seed error raised inside a worker (an InvalidImageDirectoryError, a NaN loss) reaches the user as
that same error class with its message, and Prefect's retry policy can tell a user error from a
crash. Each failing rank writes ``error_rank_<rank>.json`` into the run folder; the launcher reads
the latest attempt's, lowest rank first.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from pydantic import BaseModel

from models.atomic import write_json
from models.errors import ImageOpsError, disk_full

PATTERN = "error_rank_*.json"


class Failure(BaseModel):
    rank: int
    attempt: int
    module: str
    type: str
    message: str
    hint: str = ""
    user_error: bool

    def as_error(self) -> ImageOpsError | None:
        """The original ImageOpsError, rebuilt; None for anything else (a crash, a bug)."""
        if not self.user_error:
            return None
        try:
            cls = getattr(importlib.import_module(self.module), self.type)
        except (ImportError, AttributeError):
            return None
        if not (isinstance(cls, type) and issubclass(cls, ImageOpsError)):
            return None
        return cls(self.message, self.hint)


def record_failure(run_dir: Path, rank: int, attempt: int, exc: BaseException) -> Path:
    exc = disk_full(exc) or exc  # a full disk reaches the launcher as itself, not as a crash
    user_error = isinstance(exc, ImageOpsError)
    failure = Failure(
        rank=rank,
        attempt=attempt,
        module=type(exc).__module__,
        type=type(exc).__qualname__,
        message=exc.message if isinstance(exc, ImageOpsError) else str(exc),
        hint=exc.hint if isinstance(exc, ImageOpsError) else "",
        user_error=user_error,
    )
    return write_json(Path(run_dir) / f"error_rank_{rank}.json", failure.model_dump())


def read_failures(run_dir: Path) -> list[Failure]:
    """Recorded failures, the latest attempt first and then by rank."""
    failures = []
    for path in Path(run_dir).glob(PATTERN):
        try:
            failures.append(Failure.model_validate_json(path.read_bytes()))
        except ValueError:  # a half-written file from a killed process: not evidence
            continue
    return sorted(failures, key=lambda f: (-f.attempt, f.rank))


def clear_failures(run_dir: Path) -> None:
    for path in Path(run_dir).glob(PATTERN):
        path.unlink(missing_ok=True)
