"""Atomic writes: a crash or a retry never leaves a half file or half folder that looks whole.

Files are written to a temporary sibling and ``os.replace``d; folders are built in a temporary
sibling and renamed into place. It lives in ``models/`` because that is the bottom layer: the
model-directory format needs it and every step above may use it.

Any name the file system takes can be written so: a temporary sibling's name is short whatever
the real one is (:func:`temp_name`), and a name the file system cannot take is refused with the
limit (:func:`check_name_length`), never an ``OSError`` halfway through.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from models.errors import InvalidParameterError


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not open folders; the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Read once at import: os.umask can only be read by setting it, which races with other threads.
_UMASK = _read_umask()
# How much of the real name a temporary name keeps, so a person can tell whose it is. Bounded:
# ".<name>.<random>.tmp" from a name of 242 bytes or more would be longer than the 255 bytes
# most file systems take, while the name itself fits.
_TEMP_NAME_KEEPS = 40
NAME_MAX = 255  # bytes per name on ext4, XFS, btrfs, ZFS, APFS; asked of the file system first


def temp_name(name: str, kind: str = "tmp") -> str:
    """A new hidden name for a temporary sibling of ``name``: ``.<start of name>.<random>.<kind>``.

    Unique by its random part, and at most ``_TEMP_NAME_KEEPS + 11`` bytes plus ``kind``: short
    enough for any file system, whatever the length of ``name``.
    """
    return f"{temp_prefix(name)}.{uuid.uuid4().hex[:8]}.{kind}"


def temp_prefix(name: str) -> str:
    """``"." + name`` cut to ``_TEMP_NAME_KEEPS`` bytes (at a character boundary when it can be):
    where a temporary name for ``name`` starts, for ``tempfile``'s ``prefix=`` too."""
    raw = os.fsencode(name)
    if len(raw) <= _TEMP_NAME_KEEPS:
        return f".{name}"
    cut = raw[:_TEMP_NAME_KEEPS].decode("utf-8", "ignore") or os.fsdecode(raw[:_TEMP_NAME_KEEPS])
    return f".{cut}"


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


def write_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (readers see the old file or the new, never half)."""
    path = Path(path)
    check_name_length(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{temp_prefix(path.name)}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file 0600; give it the mode any other new file would get.
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def write_text(path: Path, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: Path, obj: Any) -> Path:
    return write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path``.

    For writers that need a file name (pandas, ONNX, safetensors) rather than bytes.
    """
    path = Path(path)
    check_name_length(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(temp_name(path.name))
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
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
    tmp = dest.with_name(temp_name(dest.name))
    tmp.mkdir()
    try:
        yield tmp
        check_destination(dest, replaces)  # it may have appeared while the work ran
        if os.path.lexists(dest):
            old = dest.with_name(temp_name(dest.name, "old"))
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
        _fsync_dir(dest.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
