"""The states a killed or failed DVC operation leaves that DVC does not get past itself.

An init cut short, an emptied record of DVC's locks, the staging files of a failed copy and a
``.dvc`` pointer cut short: each is repaired (or removed) here, holding the project's DVC lock, so
the next ``imageops version`` finds the repository as a whole operation would have left it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from models.atomic import write_bytes
from models.bounded_parse import parse_yaml
from models.errors import disk_full, full_disk_at
from tasks.shared.step import step_logger

if TYPE_CHECKING:
    from dvc.repo import Repo


def git_root(path: Path) -> Path | None:
    """The git work tree that contains ``path``, or None (a ``.git`` file marks a worktree)."""
    for folder in (path, *path.parents):
        if (folder / ".git").exists():
            return folder
    return None


# What `dvc init` puts in .dvc/ before imageops writes config.local; a cache or anything else
# means the repository was in use.
_INIT_FILES = {"config", ".gitignore", "tmp"}


def init_cut_short(dvc_dir: Path) -> bool:
    """Whether ``dvc_dir`` is what a process killed inside ``dvc init`` leaves.

    ``Repo.init`` makes ``.dvc/``, then an empty ``config``, then (outside git) writes ``no_scm``
    into it; imageops writes ``config.local`` right after. Cut short, the folder has no config,
    or outside git an empty one with which DVC refuses to open ("not a git repository"). It then
    holds nothing of value, so running the init again (``force``) loses nothing.
    """
    if not dvc_dir.is_dir() or not {p.name for p in dvc_dir.iterdir()} <= _INIT_FILES:
        return False
    config = dvc_dir / "config"
    if not config.is_file():
        return True
    return config.stat().st_size == 0 and git_root(dvc_dir.parent) is None


def repair_rwlock(repo: Repo) -> None:
    """Remove DVC's record of held locks when a killed DVC left it unreadable.

    DVC rewrites ``.dvc/tmp/rwlock`` in place (truncate, then write), under its guard
    ``rwlock.lock``; a process killed between the two leaves it empty, and every later DVC
    command fails with "JSON structure is corrupted". Holding the same guard, no one is writing
    it, so a file that does not parse is a dead writer's: its entries are lost either way, and
    DVC starts a missing record afresh.
    """
    from dvc.lock import make_lock
    from dvc.rwlock import RWLOCK_FILE, RWLOCK_LOCK

    tmp_dir = Path(repo.tmp_dir)
    record = tmp_dir / RWLOCK_FILE
    if not record.is_file():
        return
    hardlink = bool(repo.config["core"].get("hardlink_lock", False))
    with make_lock(str(tmp_dir / RWLOCK_LOCK), tmp_dir=str(tmp_dir), hardlink_lock=hardlink):
        try:
            json.loads(record.read_bytes())
        except ValueError:  # JSONDecodeError and UnicodeDecodeError both are
            step_logger(__name__).warning(
                "removed %s: a DVC process was killed while writing it", record
            )
            record.unlink()


# The staging file of DVC's local file system (dvc_objects.fs.utils.tmp_fname), beside the object.
_STAGING = re.compile(r"^\.[A-Za-z0-9_-]{22}\.tmp$")


@contextmanager
def nothing_half_done(repo: Repo, target: Path, remote: Path | None) -> Iterator[None]:
    """A failed ``dvc add`` or ``dvc push`` leaves nothing that looks whole, and a full disk is
    named as such.

    Removed: the staging files a failed copy leaves in the cache or a folder remote (DVC's local
    ``put_file`` does not remove its own: treeverse/dvc-objects#379; a 600-file push onto a full
    disk left 600), those dated from this operation on, as the project's DVC lock is held; and a
    ``.dvc`` pointer the failure emptied or cut short (the one before is put back). DVC reports
    a full remote as "N files failed to upload": the free space says why.
    """
    pointer = target.parent / f"{target.name}.dvc"
    before = pointer.read_bytes() if pointer.is_file() else None
    stores = {"the DVC cache": Path(repo.cache.local.path)}
    if remote is not None:  # a folder
        stores["the DVC remote"] = remote
    started = time.time() - 1.0  # file times are coarser than the clock on some file systems
    try:
        yield
    except BaseException as exc:
        for store in stores.values():
            _remove_staging_files(store, started)
        _put_back(pointer, before)
        if not isinstance(exc, Exception):
            raise
        places = {**stores, "the data": target.parent}
        full = next((f for what, p in places.items() if (f := full_disk_at(what, p))), None)
        named = full or disk_full(exc)
        if named is None or named is exc:
            raise
        raise named from exc


def _remove_staging_files(store: Path, since: float) -> None:
    objects = store / "files" / "md5"
    if not objects.is_dir():
        return
    for folder in objects.iterdir():
        for entry in os.scandir(folder) if folder.is_dir() else ():
            if not _STAGING.match(entry.name):
                continue
            with contextlib.suppress(OSError):  # gone already
                if entry.stat(follow_symlinks=False).st_mtime >= since:
                    os.unlink(entry.path)


def _put_back(pointer: Path, before: bytes | None) -> None:
    """The ``.dvc`` pointer as it was, when the failure left one that does not parse."""
    try:
        parse_yaml(pointer.read_bytes())["outs"][0]["md5"]
        return  # whole: the add went through, only the push did not (DVC's own behaviour)
    except FileNotFoundError:
        return
    except (OSError, yaml.YAMLError, KeyError, IndexError, TypeError):
        pass
    try:
        if before is None:
            pointer.unlink()
        else:
            write_bytes(pointer, before)
    except OSError:  # no room even for that: better no pointer than a broken one
        pointer.unlink(missing_ok=True)
        step_logger(__name__).warning(
            "removed %s, cut short by the failure: `git checkout -- %s` restores the last "
            "committed one",
            pointer,
            pointer.name,
        )
