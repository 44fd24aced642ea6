"""Folders only their owner can enter: where the stacks keep their databases, volumes and sessions.

Servers make their files with modes of their own: Ray makes its temp and session folders 0777
(sockets included), SeaweedFS its volumes 0644, SQLite and MLflow whatever the umask gives. So
the stacks keep their state inside a folder that no one else may list, enter or write (0700),
made or tightened before any server starts: then nothing below it is reachable by other users,
whatever modes the servers use. A folder (or a link to one) owned by another user is refused:
its owner could open it again at any time. Details: docs/stack.md#files-only-their-owner-can-touch.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from tasks.shared.errors import StateFolderError

OWNER_ONLY = 0o700
PASSAGE = 0o710  # owner, and a group that may pass through (not list, not write)


def private_folder(path: Path, *, group: int | None = None) -> Path:
    """``path``, made if missing, as a folder of ours that only we may enter (0700).

    ``group``: that group may pass through it too (0710), not list it: for an account that must
    reach a folder of its own below (PostgreSQL's, when we are root). Raises
    :class:`StateFolderError` when ``path`` (or the link it is) belongs to another user, or is
    not a folder.
    """
    with contextlib.suppress(FileExistsError):  # a file, or a dangling link: refused below
        path.mkdir(mode=OWNER_ONLY, parents=True, exist_ok=True)
    me = os.geteuid()
    link = path.lstat()
    info = path.stat() if path.exists() else link
    if link.st_uid != me or info.st_uid != me or not stat.S_ISDIR(info.st_mode):
        kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a folder"
        what = f"{kind} of uid {info.st_uid}"
        if stat.S_ISLNK(link.st_mode):
            what = f"a link of uid {link.st_uid} to {what}"
        raise StateFolderError(
            f"{path} is to hold a server's state, but it is {what} (this user is uid {me}): "
            "whoever owns it could read, change or replace what the servers keep there.",
            f"Remove {path} (or give it to this user), then start again.",
        )
    mode = OWNER_ONLY if group is None else PASSAGE
    if group is not None and info.st_gid != group:
        os.chown(path, -1, group)
    if stat.S_IMODE(info.st_mode) != mode:
        path.chmod(mode)
    return path


def private_tree(root: Path, *, passage: Path | None = None, group: int | None = None) -> Path:
    """``root`` as a :func:`private_folder`; with ``passage`` (a folder below ``root``, owned by
    ``group``'s account) the folders on the way to it let ``group`` pass (0710), and everything
    else in them becomes owner-only: that account reaches its own folder, and nothing else."""
    if passage is None or group is None:
        return private_folder(root)
    inner = passage.relative_to(root)
    way = [root, *(root / part for part in reversed(inner.parents[:-1]))]
    for folder in way:
        private_folder(folder, group=group)
    for folder in way:
        for child in folder.iterdir():
            if child not in way and child != passage:
                _owner_only(child)
    return root


def _owner_only(path: Path) -> None:
    """Take every permission of group and others off ``path``, when it is ours (links: never)."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode) or info.st_uid != os.geteuid():
        return
    if stat.S_IMODE(info.st_mode) & 0o077:
        path.chmod(stat.S_IMODE(info.st_mode) & OWNER_ONLY)
