"""Per-epoch checkpoints: atomic, complete, loadable with ``weights_only=True``.

Only tensors and plain values, so loading never runs code; written to a temporary file and renamed,
so a crash keeps the previous one. No RNG states: each epoch reseeds from (seed, rank, epoch), so a
resumed run draws what an uninterrupted one would. Details: docs/training.md#checkpoints.
"""

from __future__ import annotations

import pickle
import shlex
from pathlib import Path
from typing import Any

import torch

from models.atomic import atomic_file
from tasks.shared.errors import TrainingFailedError

SCHEMA_VERSION = 1


def save_checkpoint(path: Path, state: dict[str, Any]) -> Path:
    """Write ``state`` (plus the schema version) atomically to ``path``."""
    with atomic_file(Path(path)) as tmp:
        torch.save({"schema_version": SCHEMA_VERSION, **state}, tmp)
    return Path(path)


def load_checkpoint(path: Path, config_digest: str) -> dict[str, Any] | None:
    """The checkpoint at ``path`` if there is one, else None.

    Refused (TrainingFailedError) when it was written by another schema or another job (config
    digest): resuming someone else's weights under this run's name would be silently wrong.
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as exc:
        # Truncated (a disk that filled up, a copy cut short) or edited: every rerun would resume
        # it and fail the same way, so say which file and how to start over.
        raise TrainingFailedError(
            f"The checkpoint {path} cannot be read ({type(exc).__name__}: {str(exc)[:200]}): it "
            "is truncated or damaged.",
            f"Delete it (rm {shlex.quote(str(path))}) and run the same command again: the "
            "training starts afresh from epoch 1.",
        ) from None
    if not isinstance(state, dict):
        raise TrainingFailedError(
            f"The checkpoint {path} holds a {type(state).__name__}, not a training state.",
            f"Delete it (rm {shlex.quote(str(path))}) and run the same command again.",
        )
    if state.get("schema_version") != SCHEMA_VERSION:
        raise TrainingFailedError(
            f"{path} has checkpoint schema {state.get('schema_version')}, this imageops writes "
            f"{SCHEMA_VERSION}.",
            "Delete the checkpoint to start the run over, or start a new run.",
        )
    if state.get("config_digest") != config_digest:
        raise TrainingFailedError(
            f"{path} belongs to a different training configuration or data set than this run.",
            "Start a new run (a new run folder), or delete the checkpoint to train from scratch.",
        )
    return state
