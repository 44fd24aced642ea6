"""Taking turns across processes on what runs in one project share.

DVC commands, a data set's folders, the promotion decision and the first opening of a new MLflow
database each allow one user at a time. A file lock does it: the kernel frees it however its
holder ends, so a killed run never blocks the next. Waiting past the timeout means the holder is
stuck, not slow, and ends in the caller's error with what to do.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from models.errors import ImageOpsError
from models.locks import holding
from tasks.shared import faults


@contextmanager
def taking_turns(
    path: Path,
    timeout_s: float,
    error: type[ImageOpsError],
    holder: str,
    hint: str,
    waiting: str | None = None,
) -> Iterator[None]:
    """Hold the lock file ``path`` for the block; wait up to ``timeout_s`` for another holder.

    ``waiting`` is logged when another process holds it; past the timeout, ``error`` says that
    ``holder`` (e.g. "another promotion in this project") has had it all that time, and ``hint``.
    """

    def log_waiting() -> None:
        from tasks.shared.step import step_logger  # Prefect: only when someone has to wait

        step_logger(__name__).info("%s (it holds %s)", waiting, path)

    refusal = error(
        f"Waited {timeout_s:.0f} s for {path}: {holder} has held it all that time.", hint
    )
    with holding(path, timeout_s, refusal, log_waiting if waiting else None):
        faults.point("lock.acquired", name=path.stem)
        try:
            yield
        finally:
            faults.point("lock.released", name=path.stem)
