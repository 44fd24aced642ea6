"""Placing an image that a step only selects or renames: linked, not copied, where it can be.

A reflink (copy-on-write clone: XFS, btrfs, APFS) shares the blocks until either file is
written, so the two stay independent. A hard link is the same file under two names: an edit
through one name is an edit of both (and of DVC's cache when DVC links it too), so a hard-linked
file is made read-only, as DVC does with the files it links from its cache. Where neither works
(another file system, links refused, too many links), the file is copied. The choice is made per
file: one failure does not stop the next file from being linked. Details: docs/images.md#links.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Literal

Method = Literal["reflink", "hardlink", "copy"]

# What a file system or a policy answers when it cannot link these two paths: try the next way.
_CANNOT_LINK = frozenset(
    {
        errno.EXDEV,  # another file system
        errno.EPERM,  # fs.protected_hardlinks, or a file system without hard links
        errno.EACCES,
        errno.EOPNOTSUPP,
        errno.ENOTSUP,
        errno.ENOTTY,  # the ioctl is unknown to this file system
        errno.EINVAL,  # FICLONE between files it cannot share blocks of
        errno.ENOSYS,
        errno.EMLINK,  # the source has the most links its file system allows
        errno.ETXTBSY,
    }
)
_WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH


def _reflink(source: Path, target: Path) -> None:
    # DVC's own clone call (FICLONE on Linux, clonefile on macOS); imported here, not at the
    # top, so that importing a step does not import DVC's file system layer.
    from dvc_objects.fs.system import reflink

    reflink(os.fspath(source), os.fspath(target))


class Placer:
    """Places files by the cheapest way that works, remembering what failed.

    A way that failed once between two file systems is not tried again for that pair (a reflink
    on ext4 fails for every file); ``counts`` says how many files went each way, for the log.
    """

    def __init__(self) -> None:
        self.counts: Counter[Method] = Counter()
        self._failed: set[tuple[Method, int, int]] = set()
        self._devices: dict[str, int] = {}  # target folder -> its file system

    def place(self, source: str | os.PathLike[str], target: str | os.PathLike[str]) -> Method:
        """Make ``target`` (not existing; its folder does) hold the bytes of ``source``.

        Returns how: "reflink", "hardlink" (the file is then read-only under both names) or
        "copy". Errors other than "cannot link these" (a missing source, a full disk) raise.
        Paths as strings are cheapest: a split places every image of a data set.
        """
        folder = os.path.dirname(os.fspath(target))
        if (device := self._devices.get(folder)) is None:
            device = self._devices[folder] = os.stat(folder or ".").st_dev
        source_stat = os.stat(source)
        pair = (source_stat.st_dev, device)
        for method in ("reflink", "hardlink"):
            if (method, *pair) in self._failed:
                continue
            try:
                if method == "reflink":
                    _reflink(source, target)
                else:
                    os.link(source, target)
                    if source_stat.st_mode & _WRITE_BITS:  # one file: its mode as just read
                        os.chmod(target, stat.S_IMODE(source_stat.st_mode) & ~_WRITE_BITS)
            except OSError as exc:
                if exc.errno not in _CANNOT_LINK:
                    raise
                if method == "reflink" or exc.errno == errno.EXDEV:
                    # Says something of the two file systems, not of this one file (EMLINK,
                    # or EPERM from fs.protected_hardlinks, does).
                    self._failed.add((method, *pair))
                continue
            self.counts[method] += 1
            return method
        shutil.copyfile(source, target)
        self.counts["copy"] += 1
        return "copy"

    def summary(self) -> str:
        """E.g. "90 hard-linked, 0 reflinked, 0 copied"."""
        c = self.counts
        return f"{c['hardlink']} hard-linked, {c['reflink']} reflinked, {c['copy']} copied"


def can_reflink(folder: Path) -> bool:
    """Whether the file system of ``folder`` (which exists) clones files (a reflink)."""
    return _probe(folder, "reflink", _reflink)


def can_hardlink(folder: Path, other: Path) -> bool:
    """Whether files under ``other`` can be hard-linked into ``folder`` (which exists).

    One file system, and one that makes hard links (a probe in ``folder``: nothing is written
    beside ``other``, which may be a user's data).
    """
    if os.stat(folder).st_dev != os.stat(other).st_dev:
        return False
    return _probe(folder, "hardlink", os.link)


def _probe(folder: Path, kind: str, make: Callable[[Path, Path], None]) -> bool:
    """Whether ``make(file, new_name)`` works in ``folder``, tried on a file of its own."""
    probe = folder / f".{kind}-probe-{os.getpid()}"
    made = probe.with_name(probe.name + ".made")
    try:
        probe.write_bytes(b"imageops")
        make(probe, made)
    except OSError:
        return False
    else:
        return True
    finally:
        probe.unlink(missing_ok=True)
        made.unlink(missing_ok=True)
