"""The files of a training run's folder, by name.

A module of names only (no torch): the launcher, a cluster node's actor and housekeeping read
and move these files without importing what writes them.
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINT = "checkpoint.pt"  # the last epoch's state: tasks.train.checkpoint
BEST_WEIGHTS = "best.safetensors"  # the best epoch's weights so far: tasks.train.progress
RESULT = "result.json"  # rank 0's metrics, written last: tasks.train.finish
CURVES = "training_curves.png"


def rank_log(run_dir: Path, rank: int) -> Path:
    """Where the worker of global rank ``rank`` logs (tasks.train.worker writes it)."""
    return Path(run_dir) / f"rank_{rank}.log"
