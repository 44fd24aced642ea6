"""Atomic writes: a crash or a retry never leaves a half file or half folder that looks whole.

Files are written to a temporary sibling and ``os.replace``d; folders are built in one and renamed
into place. Temporary names stay short (:func:`temp_stem`) and over-long names are refused first
(:func:`check_name_length`). Each temporary is ``flock``ed while in use, so the next write removes
only dead writers' leftovers (:func:`remove_leftovers`, :func:`scratch_folder`). In ``models/``, the
bottom layer, so every layer may use it. Details: docs/internals.md#atomic-writes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from models import strict_json
from models.errors import InvalidParameterError
from models.locks import lock_fd

log = logging.getLogger(__name__)

# The random part of a temporary name: 8 hex digits here; 8 of [a-z0-9_] from tempfile's names,
# which earlier versions used and whose leftovers are removed as well.
_TOKEN = "[a-z0-9_]{8}"


# How much of the real name a temporary name keeps, so a person can tell whose it is. Bounded:
# ".<name>.<random>.tmp" from a name of 242 bytes or more would be longer than the 255 bytes
# most file systems take, while the name itself fits.
_TEMP_NAME_KEEPS = 40
NAME_MAX = 255  # bytes per name on ext4, XFS, btrfs, ZFS, APFS; asked of the file system first


def temp_stem(name: str) -> str:
    """How every temporary name of ``name`` starts: ``"." + name``, short whatever ``name`` is.

    A name over ``_TEMP_NAME_KEEPS`` bytes is cut there (at a character boundary when it can be)
    and followed by ``~`` and 8 hex digits of its digest, so two long names that start alike
    still have temporary names of their own (and :func:`remove_leftovers` tells them apart).
    """
    raw = os.fsencode(name)
    if len(raw) <= _TEMP_NAME_KEEPS:
        return "." + name
    cut = raw[:_TEMP_NAME_KEEPS].decode("utf-8", "ignore") or os.fsdecode(raw[:_TEMP_NAME_KEEPS])
    return f".{cut}~{hashlib.sha256(raw).hexdigest()[:8]}"


def temp_name(name: str, kind: str = "tmp") -> str:
    """A new hidden name for a temporary sibling of ``name``: ``<stem>.<8 hex>.<kind>``."""
    return f"{temp_stem(name)}.{secrets.token_hex(4)}.{kind}"


def name_limit(path: Path) -> int:
    """The longest name (in bytes) the file system holding ``path`` takes.

    Asked of the nearest folder that exists, since ``path`` itself usually does not yet.
    """
    folder = Path(os.path.abspath(path))
    while not os.path.isdir(folder) and folder != folder.parent:
        folder = folder.parent
    try:
        limit = int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError):  # not a POSIX system, or the file system does not say
        return NAME_MAX
    return limit if limit > 0 else NAME_MAX  # -1: no limit known


def check_name_length(path: Path, what: str = "output") -> None:
    """Refuse a ``path`` with a name longer than its file system takes: InvalidParameterError.

    Every part of the path is checked, so the message names the part that is too long (the file
    system would only say "File name too long" once some work had been done).
    """
    limit = name_limit(path)
    for part in Path(path).parts:
        size = len(os.fsencode(part))
        if size > limit:
            shown = part if len(part) <= 60 else f"{part[:28]}...{part[-28:]}"
            raise InvalidParameterError(
                f"The {what} name {shown!r} is {size} bytes long; this file system takes names "
                f"of at most {limit} bytes.",
                f"Give the {what} a name of at most {limit} bytes.",
            )


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not open folders; the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_locked(
    parent: Path, prefix: str, suffix: str, *, folder: bool, mode: int = 0o777
) -> tuple[Path, int]:
    """Create ``parent/<prefix><8 hex><suffix>``, a new file or a new folder of ``mode``, and
    lock it.

    Returns the path and the descriptor holding the lock (close it once the path is renamed or
    removed). A :func:`remove_leftovers` running at the same moment may remove the new path
    before it is locked: it is checked after locking, and made again under another name if so.
    """
    while True:
        path = parent / f"{prefix}{secrets.token_hex(4)}{suffix}"
        try:
            if folder:
                os.mkdir(path, mode)  # less the umask, as any new folder
            else:  # 0o666 less the umask: the mode any other new file gets
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        except FileExistsError:
            continue
        try:
            if folder:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            continue  # removed between mkdir and open
        try:
            lock_fd(fd, wait=True)  # a remover holds it only while it removes
            if os.path.samestat(os.fstat(fd), os.lstat(path)):
                return path, fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed before the lock was taken: another name


def _leftover_pattern(dest: Path, kind: str | None) -> re.Pattern[str]:
    name = re.escape(f"{temp_stem(dest.name)}.")
    if kind is None:
        return re.compile(rf"{name}{_TOKEN}\.(?:tmp|old)")
    return re.compile(rf"{name}{re.escape(kind)}-{_TOKEN}")


def remove_leftovers(dest: Path, kind: str | None = None) -> list[Path]:
    """Remove what killed writers of ``dest`` left beside it; return the paths removed.

    Without ``kind``: the temporary files and folders of atomic writes (``.<name>.<8>.tmp``) and
    the outputs a folder swap had moved aside (``.<name>.<8>.old``); with ``kind``, the scratch
    folders of that kind (``.<name>.<kind>-<8>``, :func:`scratch_folder`). Only names of that
    pattern, only plain files and folders (never a link), and only those no live process holds
    locked.
    """
    dest = Path(dest)
    pattern = _leftover_pattern(dest, kind)
    try:
        names = [e.name for e in os.scandir(dest.parent) if pattern.fullmatch(e.name)]
    except OSError:  # no parent folder yet: nothing left there
        return []
    removed = [dest.parent / name for name in names if _remove_unowned(dest.parent / name)]
    for path in removed:
        log.info("removed %s, left by a killed run", path)
    return removed


def _remove_unowned(path: Path) -> bool:
    """Remove ``path`` if it is a file or folder that no process holds locked."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        return False  # a link, a pipe, a device: not something a writer here made
    # O_NONBLOCK: a FIFO put there meanwhile must not block the open.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags | (os.O_DIRECTORY if stat.S_ISDIR(mode) else 0))
    except OSError:
        return False
    try:
        if not lock_fd(fd, wait=False):
            return False  # a live writer's (or a filesystem that cannot prove otherwise)
        if not os.path.samestat(os.fstat(fd), os.lstat(path)):
            return False
        if stat.S_ISDIR(mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
    except OSError:
        return False
    finally:
        os.close(fd)
    return not os.path.lexists(path)


@contextmanager
def scratch_folder(dest: Path, kind: str) -> Iterator[Path]:
    """A new private folder beside ``dest`` to work in on the way to it, removed afterwards.

    Beside ``dest``, not in /tmp: the same disk as the result, and /tmp is often small. It is
    named ``.<name>.<kind>-<8 hex>`` and locked while in use; a killed run's folders of the same
    ``kind`` are removed first (:func:`remove_leftovers`).
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(dest, kind)
    # Private (0o700), as tempfile's folders.
    stem = f"{temp_stem(dest.name)}.{kind}-"
    path, fd = _create_locked(dest.parent, stem, "", folder=True, mode=0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)


def write_bytes(path: Path, data: bytes, mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` atomically (readers see the old file or the new, never half).

    ``mode`` (e.g. 0o600 for a secret) is set before any data is written, so the data is never
    readable with a wider one.
    """
    path = Path(path)
    check_name_length(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path)
    tmp, fd = _create_locked(path.parent, f"{temp_stem(path.name)}.", ".tmp", folder=False)
    try:
        with os.fdopen(fd, "wb") as fh:  # closing it releases the lock: after the rename
            if mode is not None:
                os.fchmod(fh.fileno(), mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def write_text(path: Path, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: Path, obj: Any) -> Path:
    """``obj`` as strict JSON (NaN and infinity written as null: :mod:`models.strict_json`)."""
    return write_text(path, strict_json.dumps(obj, indent=2, sort_keys=False) + "\n")


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``.

    For writers that need a file name (pandas, ONNX, safetensors) rather than bytes. The file
    exists, empty and locked by this process, until it replaces ``path``: the writer opens it
    by name and overwrites it.
    """
    path = Path(path)
    check_name_length(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path)
    tmp, fd = _create_locked(path.parent, f"{temp_stem(path.name)}.", ".tmp", folder=False)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        os.close(fd)
    _fsync_dir(path.parent)


def check_destination(dest: Path, replaces: str | None = None) -> None:
    """Refuse a ``dest`` that writing a folder there would destroy; raise InvalidParameterError.

    A folder output may replace nothing, an empty folder, or a folder of its own kind: one that
    holds ``replaces`` (``manifest.json`` for an ImageDirectory, ``model.json`` for a model), the
    output of an earlier run. A file, a symlink or a device would be moved aside and lost; a folder
    of other things (``imageops convert photos ~/Documents``) would be deleted. A name longer than
    the file system takes is refused too. Steps call this before their work starts, so a refusal
    costs nothing and changes nothing.
    """
    dest = Path(dest)
    check_name_length(dest, "destination")
    if not os.path.lexists(dest):
        return
    what = "a symlink" if dest.is_symlink() else None
    if what is None and not dest.is_dir():
        what = "a file" if dest.is_file() else "not a folder"
    if what is not None:
        raise InvalidParameterError(
            f"The destination {dest} exists and is {what}; writing the output there would "
            "replace it.",
            "Give a destination folder that does not exist yet, or move that file away first.",
        )
    if replaces is not None and not (dest / replaces).is_file() and any(dest.iterdir()):
        raise InvalidParameterError(
            f"The destination {dest} is a folder of other files (it has no {replaces}, so "
            "imageops did not write it); writing the output there would delete them.",
            "Give a new or empty folder as the destination, or move those files away first.",
        )


@contextmanager
def atomic_directory(dest: Path, *, replaces: str | None = None) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``dest``; on success it becomes ``dest``.

    An existing ``dest`` is replaced only after the new one is complete, and only if
    :func:`check_destination` allows it (checked before and again at the swap). On any error the
    temporary folder is removed and ``dest`` is left as it was.
    """
    dest = Path(dest)
    check_destination(dest, replaces)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(dest)
    tmp, fd = _create_locked(dest.parent, f"{temp_stem(dest.name)}.", ".tmp", folder=True)
    locks = [fd]  # closed at the end; the first, tmp's, as soon as tmp is the output
    try:
        yield tmp
        check_destination(dest, replaces)  # it may have appeared while the work ran
        old = None
        if os.path.lexists(dest):
            old = dest.with_name(temp_name(dest.name, "old"))
            held = _held(dest)  # the replaced output stays locked until it is removed
            locks += [] if held is None else [held]
            os.replace(dest, old)
        try:
            os.replace(tmp, dest)
        except BaseException:
            if old is not None:  # the previous output back, rather than left to be removed
                os.replace(old, dest)
            raise
        os.close(locks.pop(0))  # the output is no temporary folder to keep for its writer
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(dest.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        for lock in locks:
            os.close(lock)


def _held(folder: Path) -> int | None:
    """A descriptor of ``folder`` holding its lock, or None when it cannot be locked now."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        if lock_fd(fd, wait=False):
            return fd
        os.close(fd)
    return None
