"""The locks a launcher holds while it trains: on its run, and on the output it writes.

Its own module because two jobs read the run's: the launch takes it, and finding a run to continue
asks whether someone holds it (a run being trained now is not merely unfinished).
"""

from __future__ import annotations

import hashlib
from contextlib import AbstractContextManager
from pathlib import Path

from models.locks import holding, is_held
from tasks.shared.errors import InvalidParameterError
from tasks.shared.settings import Settings

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


def output_lock(out: Path, settings: Settings) -> AbstractContextManager[None]:
    """Hold the lock on the ModelDirectory ``out`` while training writes it; refuse if another
    training holds it.

    Two trainings into one folder would both end well, the later one's model silently replacing
    the earlier's. The lock is kept under the project's home (keyed by the folder's full path),
    not beside the folder, so nothing appears next to a user's output.
    """
    where = str(Path(out).resolve())
    lock = (
        settings.home_dir
        / "locks"
        / f"train-output-{hashlib.sha256(where.encode()).hexdigest()[:16]}.lock"
    )
    refusal = InvalidParameterError(
        f"{where} is being written by another training right now (it holds {lock}).",
        "Wait for that training to end, or give this one another output folder.",
    )
    return holding(lock, 0, refusal)
