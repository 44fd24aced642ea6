"""Disk space to give back (``imageops gc``): what can go, how big it is, and removing it safely.

Each stage says what of its own can go (:mod:`tasks.train.retention`,
:mod:`tasks.registry.cache_retention`, :mod:`tasks.data.cache_retention`); this module holds what
they share. A folder is removed by renaming it to a hidden trash name first (one atomic step), then
deleting that: a crash midway leaves a trash folder, never a half run folder or half cache entry
under its real name, and the next ``imageops gc`` deletes the trash.
Details: docs/training.md#disk-space.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from models.atomic import temp_name

TRASH = "trash"
_TRASH_NAME = re.compile(r"^\..*\.[0-9a-f]{8}\." + TRASH + "$")


@dataclass(frozen=True)
class Reclaimable:
    """One thing ``imageops gc`` may remove: what kind, where, how many bytes, and why it may go."""

    kind: str
    path: Path
    size: int
    reason: str
    # Removes it, after checking again under the owner's lock; False when it was kept after all
    # (a job took it meanwhile).
    remove: Callable[[], bool] = field(compare=False, repr=False)

    @classmethod
    def at(cls, kind: str, path: Path, reason: str, remove: Callable[[], bool]) -> Reclaimable:
        """What ``path`` holds now, measured on disk."""
        return cls(kind=kind, path=path, size=disk_size(path), reason=reason, remove=remove)


def disk_size(path: Path) -> int:
    """Bytes of the regular files at or under ``path`` (links not followed; 0 if it is gone)."""
    try:
        top = path.lstat()
    except OSError:
        return 0
    if not stat.S_ISDIR(top.st_mode):
        return top.st_size if stat.S_ISREG(top.st_mode) else 0
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                info = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            total += info.st_size if stat.S_ISREG(info.st_mode) else 0
    return total


def newest_change(path: Path) -> float:
    """The latest modification time at or under ``path`` (what "old" is measured by)."""
    newest = path.lstat().st_mtime
    for folder, dirs, files in os.walk(path):
        for name in (*dirs, *files):
            try:
                newest = max(newest, os.lstat(os.path.join(folder, name)).st_mtime)
            except OSError:
                continue
    return newest


def trash(path: Path) -> None:
    """Remove the file or folder ``path``: renamed to a hidden trash name first, then deleted.

    The rename is atomic, so ``path`` is either whole or gone, whatever happens next; a crash
    during the delete leaves only the trash name, for :func:`left_trash` to find.
    """
    path = Path(path)
    if not os.path.lexists(path):
        return
    gone = path.with_name(temp_name(path.name, TRASH))
    os.replace(path, gone)
    _delete(gone)


def left_trash(folder: Path) -> list[Reclaimable]:
    """What an interrupted :func:`trash` left in ``folder``: nothing refers to a trash name."""
    try:
        paths = sorted(folder / e.name for e in os.scandir(folder) if _TRASH_NAME.match(e.name))
    except OSError:
        return []
    return [
        Reclaimable.at(
            TRASH,
            path,
            "left by an interrupted removal",
            partial(_delete, path),
        )
        for path in paths
    ]


def _delete(path: Path) -> bool:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    return True
