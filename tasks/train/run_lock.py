"""The lock a launcher holds on a run while it trains it.

Its own module because two jobs read it: the launch takes it, and finding a run to continue asks
whether someone holds it (a run being trained now is not merely unfinished).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

from models.locks import holding, is_held
from tasks.shared.errors import InvalidParameterError

LAUNCH_LOCK = "launch.lock"


def launch_lock(run_dir: Path, run_id: str) -> AbstractContextManager[None]:
    """Hold the run's lock while node 0's launcher trains it; refuse if another holds it.

    Two launches of one run at once would train into one checkpoint and one model. The lock
    (released by the kernel whatever way the holder dies) also tells a run that is merely
    unfinished, and may be continued, from one that is being trained right now.
    """
    refusal = InvalidParameterError(
        f"MLflow run {run_id} is being trained right now by another launcher "
        f"(it holds {run_dir / LAUNCH_LOCK}).",
        "Wait for it to end, or start a new run (leave run_id empty).",
    )
    return holding(run_dir / LAUNCH_LOCK, 0, refusal)


def in_training(run_dir: Path) -> bool:
    """True while some launcher holds ``run_dir``'s lock."""
    return is_held(run_dir / LAUNCH_LOCK)
