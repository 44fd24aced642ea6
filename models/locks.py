"""File locks, one way everywhere: the kernel's ``flock`` (through filelock), freed however the
holder ends.

So a killed run never blocks the next, and a lock still held tells a live user from a dead one.
Two forms: :func:`holding` / :func:`acquire` on a lock file (DVC, promotion, a run being trained,
a model download, Prefect's database), and :func:`lock_fd` on a descriptor the caller already has
open (a temporary file or folder being written, a scoring's checkpoint folder), where the lock is
what marks that path as in use. :func:`sharing` is the shared form of a lock file: any number of
readers hold it at once, and it keeps out whoever wants it alone (:func:`acquire` on the same
path), as a scoring keeps ``imageops gc`` off the registry-cache entry it reads. In ``models/``, the
bottom layer, so every layer can use it.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout, lock_descriptor

from models.errors import ImageOpsError


def lock_fd(fd: int, *, wait: bool) -> bool:
    """Lock ``fd`` exclusively: True when held; False when another process holds it (``wait``
    False) or the file system cannot lock it (NFS cannot lock a folder)."""
    try:
        return lock_descriptor(fd, blocking=wait)
    except OSError:  # EBADF, ENOLCK, EINVAL: cannot lock
        return False


def acquire(
    path: Path,
    timeout_s: float,
    refusal: ImageOpsError,
    waiting: Callable[[], object] | None = None,
) -> FileLock:
    """The lock file ``path``, held (call ``release()``); wait up to ``timeout_s`` for another
    holder, 0 for not at all.

    ``waiting`` is called once when another process holds it (to log that this one waits);
    ``refusal``, an error naming the lock file and what to do, is raised past the timeout.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        if waiting is not None:
            waiting()
        try:
            if timeout_s <= 0:
                raise
            lock.acquire(timeout=timeout_s)
        except Timeout as exc:
            raise refusal from exc
    return lock


@contextmanager
def holding(
    path: Path,
    timeout_s: float,
    refusal: ImageOpsError,
    waiting: Callable[[], object] | None = None,
) -> Iterator[None]:
    """Hold the lock file ``path`` for the block (see :func:`acquire`)."""
    lock = acquire(path, timeout_s, refusal, waiting)
    try:
        yield
    finally:
        lock.release()


def is_held(path: Path) -> bool:
    """True while some process holds the lock file ``path``."""
    if not path.is_file():
        return False
    lock = FileLock(path)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        return True
    lock.release()
    return False


SHARING_POLL_S = 0.05


@contextmanager
def sharing(path: Path, timeout_s: float, refusal: ImageOpsError) -> Iterator[None]:
    """Hold the lock file ``path`` shared for the block: beside other sharers, never beside an
    exclusive holder (:func:`acquire`: the same kernel ``flock``, so a kill frees it too).

    Waits up to ``timeout_s`` while someone holds it exclusively, then raises ``refusal``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise refusal from None
                time.sleep(SHARING_POLL_S)
        yield
    finally:
        os.close(fd)  # frees the lock
