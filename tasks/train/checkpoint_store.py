"""Checkpoints beyond the run folder: copied to ``checkpoint_url`` so any machine can resume a run.

A multi-node job restarted on other machines finds no run folder of its own there: rank 0 uploads
each epoch's checkpoint to ``<checkpoint_url>/<run_id>/checkpoint.pt`` (an ``s3://`` URL on the
settings' S3 server, or a folder), the best weights beside it under their own name, and a
restarted job downloads them first. An S3 object appears
whole when its upload completes, and a download or a folder copy replaces the local file only
once complete, so a crash on either side leaves the previous checkpoint. The keys come from
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from models.atomic import atomic_file
from tasks.shared.errors import InvalidParameterError, ObjectStoreError
from tasks.shared.object_store import S3Url, s3_client
from tasks.shared.settings import Settings
from tasks.train.run_folder import CHECKPOINT

if TYPE_CHECKING:
    from botocore.client import BaseClient

_S3 = "s3://"


def _s3_location(url: str, run_id: str, name: str = CHECKPOINT) -> tuple[str, str]:
    """``(bucket, key)`` of ``run_id``'s file ``name`` under ``s3://bucket/prefix``."""
    try:
        place = S3Url.parse(url) / run_id / name
    except InvalidParameterError:
        raise InvalidParameterError(
            f"The checkpoint URL {url!r} names no bucket.",
            "Set IMAGEOPS_CHECKPOINT_URL to s3://BUCKET/PREFIX or to a folder.",
        ) from None
    return place.bucket, place.key


def _folder_location(url: str, run_id: str, settings: Settings, name: str = CHECKPOINT) -> Path:
    if "://" in url:
        raise InvalidParameterError(
            f"The checkpoint URL {url!r} is neither s3:// nor a folder.",
            "Set IMAGEOPS_CHECKPOINT_URL to s3://BUCKET/PREFIX or to a folder.",
        )
    folder = Path(url).expanduser()
    folder = folder if folder.is_absolute() else settings.project_root.resolve() / folder
    return folder / run_id / name


def _client(settings: Settings) -> BaseClient:
    return s3_client(settings.s3_endpoint_url)


def _s3_error(exc: Exception, action: str, url: str, settings: Settings) -> ObjectStoreError:
    where = settings.s3_endpoint_url or "AWS"
    return ObjectStoreError(
        f"Could not {action} the checkpoint {url} (S3 at {where}): {exc}",
        "Check that the S3 server answers at IMAGEOPS_S3_ENDPOINT_URL, that the bucket exists "
        "and that AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY may read and write it.",
    )


def upload_checkpoint(local: Path, run_id: str, settings: Settings) -> None:
    """Copy the file ``local`` to ``run_id``'s place under ``settings.checkpoint_url``, by name.

    Does nothing without a checkpoint URL (checkpoints then stay in the run folder). Raises
    :class:`ObjectStoreError` naming the URL when S3 refuses or does not answer.
    """
    url = settings.checkpoint_url
    if url is None:
        return
    if not url.startswith(_S3):
        with atomic_file(_folder_location(url, run_id, settings, Path(local).name)) as tmp:
            shutil.copyfile(local, tmp)
        return
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = _s3_location(url, run_id, Path(local).name)
    try:
        _client(settings).upload_file(str(local), bucket, key)
    except (BotoCoreError, ClientError) as exc:
        raise _s3_error(exc, "upload", f"{_S3}{bucket}/{key}", settings) from exc


def download_checkpoint(run_id: str, dest: Path, settings: Settings) -> bool:
    """Write ``run_id``'s stored file named as ``dest`` to ``dest``; False when there is none.

    ``dest`` is replaced only by a complete copy. Raises :class:`ObjectStoreError` naming the
    URL when S3 refuses or does not answer (a missing checkpoint is no error).
    """
    url = settings.checkpoint_url
    if url is None:
        return False
    if not url.startswith(_S3):
        source = _folder_location(url, run_id, settings, Path(dest).name)
        if not source.is_file():
            return False
        with atomic_file(Path(dest)) as tmp:
            shutil.copyfile(source, tmp)
        return True
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = _s3_location(url, run_id, Path(dest).name)
    try:
        response = _client(settings).get_object(Bucket=bucket, Key=key)
        with response["Body"] as body, atomic_file(Path(dest)) as tmp, tmp.open("wb") as out:
            shutil.copyfileobj(body, out, 1 << 20)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return False
        raise _s3_error(exc, "download", f"{_S3}{bucket}/{key}", settings) from exc
    except BotoCoreError as exc:
        raise _s3_error(exc, "download", f"{_S3}{bucket}/{key}", settings) from exc
    return True


def stored_checkpoint(run_id: str, settings: Settings) -> bool:
    """Whether ``run_id`` has a checkpoint under ``settings.checkpoint_url`` to resume from."""
    url = settings.checkpoint_url
    if url is None:
        return False
    if not url.startswith(_S3):
        return _folder_location(url, run_id, settings).is_file()
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = _s3_location(url, run_id)
    try:
        _client(settings).head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
            return False
        raise _s3_error(exc, "look up", f"{_S3}{bucket}/{key}", settings) from exc
    except BotoCoreError as exc:
        raise _s3_error(exc, "look up", f"{_S3}{bucket}/{key}", settings) from exc
    return True


def discard_stored_checkpoint(run_id: str, names: list[str], settings: Settings) -> None:
    """Delete ``run_id``'s stored files ``names`` under ``settings.checkpoint_url``, if any.

    For a FINISHED run only: nothing resumes it, so its checkpoint is dead weight. Raises
    :class:`ObjectStoreError` naming the URL when S3 refuses or does not answer.
    """
    url = settings.checkpoint_url
    if url is None:
        return
    if not url.startswith(_S3):
        for name in names:
            _folder_location(url, run_id, settings, name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # only when nothing else is left in it
            _folder_location(url, run_id, settings).parent.rmdir()
        return
    from botocore.exceptions import BotoCoreError, ClientError

    for name in names:
        bucket, key = _s3_location(url, run_id, name)
        try:
            _client(settings).delete_object(Bucket=bucket, Key=key)
        except (BotoCoreError, ClientError) as exc:
            raise _s3_error(exc, "delete", f"{_S3}{bucket}/{key}", settings) from exc
