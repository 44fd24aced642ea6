"""The lock a launcher holds on a run while it trains it.

Its own module because two jobs read it: the launch takes it, and finding a run to continue asks
whether someone holds it (a run being trained now is not merely unfinished).
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from tasks.errors import InvalidParameterError

LAUNCH_LOCK = "launch.lock"


@contextlib.contextmanager
def launch_lock(run_dir: Path, run_id: str) -> Iterator[None]:
    """Hold the run's lock while node 0's launcher trains it; refuse if another holds it.

    Two launches of one run at once would train into one checkpoint and one model. The lock
    (``flock``, released by the kernel whatever way the holder dies) also tells a run that is
    merely unfinished, and may be continued, from one that is being trained right now.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LAUNCH_LOCK, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InvalidParameterError(
                f"MLflow run {run_id} is being trained right now by another launcher.",
                "Wait for it to end, or start a new run (leave run_id empty).",
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def in_training(run_dir: Path) -> bool:
    """True while some launcher holds ``run_dir``'s lock."""
    path = run_dir / LAUNCH_LOCK
    if not path.is_file():
        return False
    with open(path, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
    return False
