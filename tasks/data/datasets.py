"""Named data sets: a pipeline run prepares its data in ``data/<name>/`` and owns it while it runs.

Runs on different data sets write different folders (images, train and val), so they can run at
once. Two runs on the same data set would replace each other's split halfway through training, so
they take turns on a file lock per data set (``<home>/locks/data-<name>.lock``): the second waits
for the first to end. The kernel releases the lock whatever way its holder dies.

Within that, each data set folder has a lock of its own (:func:`holding_folders`), taken by every
step that writes one (convert, split, transform apply, sample digits) and by ``version``: a
version is one state of the folder, never half of one split and half of the next. Order, to
never deadlock: the data set's lock, then folders' locks (sorted), then the project's DVC lock.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

from models.locks import is_held
from tasks.data.archive import ARCHIVE_SUFFIXES
from tasks.shared.errors import DatasetBusyError
from tasks.shared.project_lock import taking_turns
from tasks.shared.settings import Settings, get_settings

# One path component that every file system and DVC take as it is.
NAME_RULE = "letters, digits, '.', '_' and '-', not starting with a dot, at most 100 characters"
NAME_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}$"
_NAME = re.compile(NAME_PATTERN)
# data/raw holds the raw sources, data/repro the DVC stages' outputs (dvc.yaml): not data sets.
RESERVED = frozenset({"raw", "repro"})
# Another run on the same data set trains in between; past this, it is stuck, not slow.
LOCK_TIMEOUT_S = 12 * 3600.0
# A convert of a large source, or a version pushed to a slow remote, holds a folder this long.
FOLDER_LOCK_TIMEOUT_S = 6 * 3600.0
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


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


def folder_lock_path(settings: Settings, folder: Path) -> Path:
    """The lock file of ``folder``: one per real path (``data/x`` and ``./data/../data/x`` share
    it), under the project's home, readable by the folder's name."""
    real = Path(folder).resolve()
    digest = hashlib.sha256(os.fsencode(real)).hexdigest()[:16]
    return settings.home_dir / "locks" / f"folder-{_UNSAFE.sub('_', real.name)[:40]}-{digest}.lock"


@contextmanager
def holding_folders(
    *folders: Path, settings: Settings | None = None, timeout_s: float = FOLDER_LOCK_TIMEOUT_S
) -> Iterator[None]:
    """Hold the lock of each of ``folders`` (read or written by the block), waiting for other
    holders; in one order (the lock files' names), so two steps never wait for each other."""
    settings = settings or get_settings()
    locks = {folder_lock_path(settings, Path(f)): Path(f) for f in folders}
    with ExitStack() as stack:
        for path in sorted(locks):
            stack.enter_context(
                taking_turns(
                    path,
                    timeout_s,
                    DatasetBusyError,
                    f"another imageops step writing or versioning {locks[path]}",
                    "Check for a stuck `imageops` process (convert, split, transform apply, "
                    "version or run) and stop it, then retry.",
                    waiting=f"waiting for another imageops step using {locks[path]}",
                )
            )
        yield
