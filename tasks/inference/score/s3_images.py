"""Images to score under an ``s3://`` prefix: listed page by page, each read when its batch is.

The same rules as a local folder (:mod:`tasks.inference.score.images`): a prefix holding a
``manifest.json`` is an ImageDirectory (its list, classes and order; only the manifest is fetched
to read it), any other is walked: every object with an image extension below it, none under a
hidden name, sorted part by part. An image's bytes are fetched into memory by the reader that
decodes it, so nothing of the input is copied to the local disk. The client is the settings' (the
team's S3 server, the keys in the environment). Details: docs/scoring.md#object-storage.
"""

from __future__ import annotations

import dataclasses
import io
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

from tasks.data.imagedir import MANIFEST, is_image_file
from tasks.data.imageformat import ImageRefused, file_over_limit
from tasks.data.transform import AppliedTransform, applied_to
from tasks.inference.score.images import ImageRef, image_order, list_slice
from tasks.shared.errors import ObjectStoreError
from tasks.shared.object_store import S3Url, endpoint_url, s3_error, shared_client


def list_objects(prefix: S3Url, action: str = "list") -> Iterator[dict]:
    """Every object below ``prefix`` as S3 lists them (``Key``, ``Size``, ``ETag``), a page of
    1,000 at a time. Raises :class:`ObjectStoreError` naming the prefix and the server."""
    from botocore.exceptions import BotoCoreError, ClientError

    pages = shared_client().get_paginator("list_objects_v2")
    try:
        for page in pages.paginate(Bucket=prefix.bucket, Prefix=prefix.below):
            yield from page.get("Contents", [])
    except (BotoCoreError, ClientError) as exc:
        raise s3_error(exc, action, prefix) from exc


def _stamps(prefix: S3Url) -> dict[str, str]:
    """Each image below ``prefix`` (its key below it) -> its size and ETag, in the input's order.

    Raises :class:`ObjectStoreError` when nothing at all is below it: a prefix that does not exist.
    """
    stamps, seen = {}, False
    for obj in list_objects(prefix):
        seen = True
        rel = obj["Key"][len(prefix.below) :]
        parts = PurePosixPath(rel).parts
        if parts and not any(p.startswith(".") for p in parts) and is_image_file(Path(rel)):
            stamps[rel] = f"{obj['Size']}:{obj.get('ETag', '')}"
        elif rel == MANIFEST:
            stamps[rel] = ""
    if not seen:
        raise ObjectStoreError(
            f"There is nothing under {prefix} (S3 at {endpoint_url() or 'AWS'}): no such prefix.",
            f"Check the prefix: `aws s3 ls {prefix}/` lists what is there.",
        )
    return dict(sorted(stamps.items(), key=lambda item: image_order(item[0])))


def list_s3_slice(
    prefix: S3Url, bounds: Callable[[int], tuple[int, int]]
) -> tuple[list[ImageRef], bool, int, int]:
    """:func:`tasks.inference.score.images.list_slice` of the images under ``prefix``."""
    stamps = _stamps(prefix)
    if MANIFEST not in stamps:
        found = list(stamps)
        first, last = bounds(len(found))
        refs = [ImageRef(prefix, rel, None, stamp=stamps[rel]) for rel in found[first:last]]
        return refs, False, first, len(found)
    with tempfile.TemporaryDirectory(prefix=".imageops-manifest-") as local:
        fetch_manifest(prefix, Path(local))
        refs, labeled, first, total = list_slice(Path(local), bounds)
    stamped = [dataclasses.replace(r, root=prefix, stamp=stamps.get(r.path)) for r in refs]
    return stamped, labeled, first, total


def fetch_manifest(prefix: S3Url, folder: Path) -> bool:
    """Copy ``prefix``'s ``manifest.json`` (an ImageDirectory's list: no image) into ``folder``;
    False when the prefix has none (raw images)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        manifest = (prefix / MANIFEST).key
        shared_client().download_file(prefix.bucket, manifest, str(folder / MANIFEST))
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise s3_error(exc, "read", prefix / MANIFEST) from exc
    except BotoCoreError as exc:
        raise s3_error(exc, "read", prefix / MANIFEST) from exc
    return True


def s3_applied_to(prefix: S3Url) -> AppliedTransform | None:
    """:func:`tasks.data.transform.applied_to` of an ImageDirectory in S3 (None: raw images)."""
    with tempfile.TemporaryDirectory(prefix=".imageops-manifest-") as local:
        return applied_to(Path(local)) if fetch_manifest(prefix, Path(local)) else None


def read_object(url: S3Url) -> io.BytesIO:
    """An image's bytes, fetched into memory; an object over convert's size limit is refused
    (:class:`ImageRefused`) before its body is read. Raises ObjectStoreError when S3 refuses."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        answer = shared_client().get_object(Bucket=url.bucket, Key=url.key)
        with answer["Body"] as body:
            refused = file_over_limit(answer["ContentLength"])
            if refused:
                raise ImageRefused(refused)
            return io.BytesIO(body.read())
    except (BotoCoreError, ClientError) as exc:
        raise s3_error(exc, "read", url) from exc
