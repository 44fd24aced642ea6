"""Which files of a stack's state another local user could read or write: the tests' walk.

A path is open to others when its mode gives group or others read or write, and no folder on
the way to it (from the state folder down, the state folder included) is the user's and closed
to everyone else (no group or other bit). Links that leave the state folder (Ray's short session
folder) are followed, their target counted as reachable (it is under the system's temp folder).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


def open_to_others(root: Path) -> list[str]:
    """Every path under ``root`` another user may read or write, as ``path (mode)``."""
    me = os.geteuid()
    found: list[str] = []
    root = root.resolve()  # a state folder may be a link (Ray's, to its short folder)
    walked = [root]  # and the folders links led out to

    def walk(path: Path, closed: bool) -> None:
        try:
            info = path.lstat()
        except FileNotFoundError:  # a server removed it meanwhile (a journal, a session file)
            return
        if stat.S_ISLNK(info.st_mode):
            target = path.resolve()
            if target.exists() and not any(target.is_relative_to(w) for w in walked):
                walked.append(target)
                walk(target, closed=False)
            return
        mode = stat.S_IMODE(info.st_mode)
        if not closed and mode & 0o066:
            found.append(f"{path} ({mode:o}, uid {info.st_uid})")
        if stat.S_ISDIR(info.st_mode):
            closed = closed or (info.st_uid == me and not mode & 0o077)
            with contextlib.suppress(FileNotFoundError):
                for child in sorted(path.iterdir()):
                    walk(child, closed)

    walk(root, closed=False)
    return found
