"""Tags of data set versions (``latest``, ``v1``, ...), kept in the DVC remote beside the data.

A tag names one version (md5) of one data set (its path under ``data/``). The record lives in the
remote itself, read and written through DVC's own file system of that remote (a folder, S3, ...),
so every machine that shares the remote sees the same tags and nothing else has to be shared.
One record is one small JSON object at ``<remote>/imageops/tags/<quoted name>/<tag>``, written
whole or not at all: S3 stores an object in one PUT, and DVC's local file system writes a temporary
file beside it and renames it. DVC's own objects live under ``files/md5`` (and two-hex-digit
folders for DVC 2), which ``dvc gc --cloud`` walks; it never sees these records.
"""

from __future__ import annotations

import io
import json
import re
import socket
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from tasks.shared.errors import InvalidParameterError
from tasks.shared.settings import Settings

if TYPE_CHECKING:
    from dvc.repo import Repo

LATEST = "latest"
RECORDS_DIR = "imageops/tags"
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
_MD5 = re.compile(r"^[0-9a-f]{32}(\.dir)?$")
TAG_RULE = "letters, digits, '_', '.' and '-', starting with a letter or digit (100 at most)"


def is_md5(version: str) -> bool:
    """A DVC md5 (32 hex digits, ``.dir`` for a folder), as opposed to a tag."""
    return _MD5.match(version) is not None


def check_tag(tag: str) -> str:
    """``tag`` when it can name a version; InvalidParameterError (saying what can) otherwise."""
    if not _TAG.match(tag) or is_md5(tag.lower()):
        raise InvalidParameterError(
            f"{tag!r} is not a usable data version tag.",
            f"Use {TAG_RULE}; 32 hex digits are an md5, not a tag.",
        )
    return tag


def dataset_name(path: Path, settings: Settings) -> str:
    """The name a versioned folder goes by: its path under ``data/`` (``digits/train``).

    A folder of the project outside ``data/`` goes by its path from the project root.
    """
    target = Path(path).resolve()
    for base in (settings.data_path.resolve(), settings.project_root.resolve()):
        if target != base and target.is_relative_to(base):
            return target.relative_to(base).as_posix()
    return target.name


def _record_path(repo: Repo, name: str, tag: str) -> tuple[object, str]:
    """The remote's file system and the path of the record of ``name``'s ``tag``."""
    remote = repo.cloud.get_remote(None, "tag")
    fs = remote.fs
    return fs, fs.join(remote.path, RECORDS_DIR, quote(name, safe=""), tag)


def write_tags(repo: Repo, name: str, md5: str, tags: list[str]) -> None:
    """Point each of ``tags`` of data set ``name`` at version ``md5``, in ``repo``'s remote."""
    record = {
        "name": name,
        "md5": md5,
        "host": socket.gethostname(),
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    for tag in tags:
        fs, path = _record_path(repo, name, tag)
        data = json.dumps({**record, "tag": tag}, sort_keys=True).encode()
        fs.upload_fobj(io.BytesIO(data), path)  # type: ignore[attr-defined]


def read_tag(repo: Repo, name: str, tag: str) -> str | None:
    """The md5 that ``tag`` of data set ``name`` points at in ``repo``'s remote; None if none."""
    fs, path = _record_path(repo, name, tag)
    try:
        record = json.loads(fs.cat_file(path))  # type: ignore[attr-defined]
    except FileNotFoundError:
        return None
    except ValueError:  # not ours, or damaged by hand: as good as absent
        return None
    md5 = record.get("md5") if isinstance(record, dict) else None
    return md5 if isinstance(md5, str) and is_md5(md5) else None
