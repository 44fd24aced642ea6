"""Named data sets: a pipeline run prepares its data in ``data/<name>/`` and owns it while it runs.

Runs on different data sets write different folders (images, train and val), so they can run at
once. Two runs on the same data set would replace each other's split halfway through training, so
they take turns on a file lock per data set (``<home>/locks/data-<name>.lock``): the second waits
for the first to end. The kernel releases the lock whatever way its holder dies.
"""

from __future__ import annotations

import re
from contextlib import AbstractContextManager
from pathlib import Path

from models.locks import is_held
from tasks.data.archive import ARCHIVE_SUFFIXES
from tasks.shared.errors import DatasetBusyError
from tasks.shared.project_lock import taking_turns
from tasks.shared.settings import Settings

# One path component that every file system and DVC take as it is.
NAME_RULE = "letters, digits, '.', '_' and '-', not starting with a dot, at most 100 characters"
NAME_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$"
_NAME = re.compile(NAME_PATTERN)
# data/raw holds the raw sources, data/repro the DVC stages' outputs (dvc.yaml): not data sets.
RESERVED = frozenset({"raw", "repro"})
# Another run on the same data set trains in between; past this, it is stuck, not slow.
LOCK_TIMEOUT_S = 12 * 3600.0


def source_name(source: str | Path) -> str:
    """The data set name a source gives: its folder's name, or its archive's without the suffix."""
    name = Path(source).name
    for suffix in sorted(ARCHIVE_SUFFIXES, key=len, reverse=True):  # the archives convert reads
        if name.lower().endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a data set folder, or None when it can."""
    if not _NAME.match(name):
        return f"use {NAME_RULE}"
    if name in RESERVED:
        return f"{name!r} is taken: data/{name} holds other things"
    return None


def _lock_path(settings: Settings, name: str) -> Path:
    return settings.home_dir / "locks" / f"data-{name}.lock"


def dataset_lock(
    settings: Settings, name: str, timeout_s: float = LOCK_TIMEOUT_S
) -> AbstractContextManager[None]:
    """Hold data set ``name`` for one run; say so when another run has it, and wait for it."""
    return taking_turns(
        _lock_path(settings, name),
        timeout_s,
        DatasetBusyError,
        f"another imageops run using data/{name}",
        "Check for a stuck `imageops run` and stop it, or run on another data set "
        "(--dataset NAME).",
        waiting=f"waiting for another run using data set {name}",
    )


def dataset_in_use(settings: Settings, name: str) -> bool:
    """True while a run holds data set ``name`` (its outputs may still be written)."""
    return is_held(_lock_path(settings, name))
