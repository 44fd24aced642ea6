"""The files of a training run's folder, by name.

A module of names only (no torch): the launcher, a cluster node's actor and housekeeping read
and move these files without importing what writes them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

CHECKPOINT = "checkpoint.pt"  # the last epoch's state: tasks.train.checkpoint
BEST_WEIGHTS = "best.safetensors"  # the best epoch's weights so far: tasks.train.progress
RESULT = "result.json"  # rank 0's metrics, written last: tasks.train.finish
CURVES = "training_curves.png"


def rank_log(run_dir: Path, rank: int) -> Path:
    """Where the worker of global rank ``rank`` logs (tasks.train.worker writes it)."""
    return Path(run_dir) / f"rank_{rank}.log"


def torchrun_log(run_dir: Path, ranks: Iterable[int]) -> Path:
    """Where a cluster node's torchrun output goes: named by the global ranks it ran.

    With c10d rendezvous torchrun numbers the nodes itself, so a gang's node 1 may run ranks
    0..P-1: the ranks, not the gang's index, say whose output it is. A launch whose workers never
    started (a rendezvous that failed) ran no rank: ``torchrun_unranked.log``.
    """
    ranks = sorted(set(ranks))
    if not ranks:
        return Path(run_dir) / "torchrun_unranked.log"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return Path(run_dir) / f"torchrun_ranks_{ranks[0]}-{ranks[-1]}.log"
    return Path(run_dir) / f"torchrun_ranks_{'_'.join(map(str, ranks))}.log"


def rank_of(log: Path) -> int | None:
    """The global rank whose :func:`rank_log` ``log`` is, else None."""
    found = re.fullmatch(r"rank_(\d+)\.log", Path(log).name)
    return int(found.group(1)) if found else None


def run_logs(run_dir: Path) -> list[Path]:
    """Every rank's log by rank, then the torchrun logs (one machine's, or each cluster node's
    by its first rank), as the run's records list them."""

    def first_number(path: Path) -> tuple[int, str]:
        found = re.search(r"\d+", path.name)
        return (int(found.group()) if found else -1, path.name)

    run_dir = Path(run_dir)
    ranks = sorted(run_dir.glob("rank_*.log"), key=first_number)
    return [*ranks, *sorted(run_dir.glob("torchrun*.log"), key=first_number)]
