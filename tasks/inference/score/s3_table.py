"""The scored table in S3: one part per shard under the prefix, made whole by a marker written last.

``dest`` = ``s3://bucket/prefix`` holds ``part-00000.parquet``, ``part-00001.parquet``, ... (CSV
parts when the prefix's last name ends in ``.csv``, as Spark names a folder of CSV parts) and
``_SUCCESS``, a JSON manifest of the parts and their rows. As Spark and Hadoop do, each shard's
part is uploaded whole under ``_temporary/<checkpoint key>/`` as it finishes; once all are there
they are copied in place and the marker is written last, so a reader that checks ``_SUCCESS``
(and reads the parts it lists) never takes a half table. A run killed before that and started
again scores only the parts missing under ``_temporary`` (the key is the one local shards use,
:func:`tasks.inference.score.shards.checkpoint_key`). A part is written to a private temporary
file first (one shard's table: the largest local file of the run), uploaded, then removed.
Details: docs/scoring.md#object-storage.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from tasks.inference.score.batches import LOGGER
from tasks.inference.score.images import list_images
from tasks.inference.score.s3_images import list_objects
from tasks.inference.score.shards import (
    ShardedScoring,
    ShardJob,
    ShardRunner,
    checkpoint_key,
)
from tasks.inference.score.table import ERROR_COLUMN, NOT_SCORED_HINT
from tasks.inference.tables import table_format
from tasks.shared import faults
from tasks.shared.errors import NoUsableImagesError
from tasks.shared.object_store import S3Url, s3_error, shared_client
from tasks.shared.step import step_logger

MARKER = "_SUCCESS"  # written last: the parts it lists are the whole table
TEMPORARY = "_temporary"  # finished parts of a run not yet published, by checkpoint key
PART = "part-{:05d}{}"


def part_suffix(dest: S3Url) -> str:
    """The parts' format: CSV when the prefix's name ends in ``.csv``, else Parquet."""
    return ".csv" if dest.suffix.lower() == ".csv" else ".parquet"


def upload_part(local: Path, dest: S3Url) -> None:
    """Upload a written table to ``dest`` whole, with its row counts (for the marker)."""
    errors = table_format(local).read(local, [ERROR_COLUMN], columns=[ERROR_COLUMN])
    counts = {"rows": str(len(errors)), "scored": str(int((errors[ERROR_COLUMN] == "").sum()))}
    _request(
        "write",
        dest,
        "upload_file",
        str(local),
        dest.bucket,
        dest.key,
        ExtraArgs={"Metadata": counts},
    )


def _request(action: str, url: S3Url, method: str, *args: object, **kwargs: object) -> dict:
    """One S3 call on ``url``; :class:`ObjectStoreError` naming it and the server if it fails."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return getattr(shared_client(), method)(*args, **kwargs)
    except (BotoCoreError, ClientError) as exc:
        raise s3_error(exc, action, url) from exc


def score_to_object_store(scoring: ShardedScoring, run_shards: ShardRunner) -> S3Url:
    """:func:`tasks.inference.score.shards.score_sharded` into the S3 prefix ``scoring.dest``.

    The images are listed and the prefix checked before anything is scored or written: a prefix
    that does not exist or keys without permission fail with nothing written. Returns ``dest``.
    """
    dest = scoring.dest
    assert isinstance(dest, S3Url)
    suffix = part_suffix(dest)
    refs, labeled = list_images(scoring.images)
    total = len(refs)
    if not total:
        raise NoUsableImagesError(f"No image found in {scoring.images}.")
    count = max(1, -(-total // scoring.shard_images))
    kwargs = {"batch_size": scoring.batch_size, "quantized": scoring.quantized}
    key = checkpoint_key(
        scoring.model, refs, labeled, suffix, shard_images=scoring.shard_images, **kwargs
    )
    del refs  # each shard lists the images again
    work = dest / TEMPORARY / key
    finished = {obj["Key"] for obj in list_objects(work, "write under")}
    parts = [work / PART.format(i, suffix) for i in range(count)]
    missing = [i for i, part in enumerate(parts) if part.key not in finished]
    log = step_logger(LOGGER)
    if len(missing) < count:
        log.warning(
            "Reusing %d of %d finished shards from an interrupted run in %s",
            count - len(missing),
            count,
            work,
        )
    run_shards(
        [
            ShardJob(
                scoring.model,
                scoring.images,
                parts[i],
                (i, count),
                threads=scoring.threads,
                **kwargs,
            )
            for i in missing
        ]
    )
    scored = _publish(parts, dest, work)
    log.info("Scored %d of %d image(s) in %d part(s) into %s", scored, total, count, dest)
    return dest


def _publish(parts: list[S3Url], dest: S3Url, work: S3Url) -> int:
    """Copy the finished ``parts`` in place under ``dest`` and write the marker last; the scored
    rows. An older table there stops looking whole (its marker goes) before any part changes."""
    listed = []
    for part in parts:
        head = _request("read", part, "head_object", Bucket=part.bucket, Key=part.key)
        meta = head.get("Metadata", {})
        listed.append({"rows": int(meta["rows"]), "scored": int(meta["scored"])})
    scored = sum(p["scored"] for p in listed)
    if not scored:
        _remove([part.key for part in parts], work)  # a verdict: a rerun would only repeat it
        rows = sum(p["rows"] for p in listed)
        raise NoUsableImagesError(f"None of the {rows} image(s) could be scored.", NOT_SCORED_HINT)
    marker = dest / MARKER
    _request("write", marker, "delete_object", Bucket=dest.bucket, Key=marker.key)
    names = []
    for i, part in enumerate(parts):
        final = dest / part.name
        source = {"Bucket": part.bucket, "Key": part.key}
        _request(
            "write", final, "copy_object", Bucket=dest.bucket, Key=final.key, CopySource=source
        )
        names.append(part.name)
        listed[i] = {"name": part.name, **listed[i]}
    stale = [  # parts of an older, longer table, or of the other format
        obj["Key"]
        for obj in list_objects(dest, "write under")
        if "/" not in obj["Key"][len(dest.below) :]
        and obj["Key"][len(dest.below) :].startswith("part-")
        and obj["Key"][len(dest.below) :] not in names
    ]
    _remove(stale, dest)
    faults.point("score.parts_published", parts=len(parts))
    manifest = {"parts": listed, "rows": sum(p["rows"] for p in listed), "scored": scored}
    _request(
        "write",
        marker,
        "put_object",
        Bucket=dest.bucket,
        Key=marker.key,
        Body=json.dumps(manifest, indent=1).encode(),
        ContentType="application/json",
    )
    _remove([part.key for part in parts], work)
    return scored


def _remove(keys: list[str], where: S3Url) -> None:
    """Delete ``keys`` (a thousand a request, S3's most)."""
    for start in range(0, len(keys), 1000):
        objects = [{"Key": k} for k in keys[start : start + 1000]]
        _request(
            "write",
            where,
            "delete_objects",
            Bucket=where.bucket,
            Delete={"Objects": objects, "Quiet": True},
        )


def read_parts(
    dest: S3Url, columns: Sequence[str] | None = None, text: Sequence[str] = ()
) -> Iterator[pd.DataFrame]:
    """The table under ``dest`` a part at a time, as its marker lists them (only those of
    ``columns`` a part has, when given: an unlabelled table has no true-label column; ``text``
    columns as strings). A part is read into memory, never onto the disk. Raises
    :class:`ObjectStoreError` when the prefix has no marker: no whole table is there."""
    marker = dest / MARKER
    answer = _request("read", marker, "get_object", Bucket=dest.bucket, Key=marker.key)
    with answer["Body"] as body:
        listed = json.loads(body.read())["parts"]
    for part in listed:
        url = dest / part["name"]
        answer = _request("read", url, "get_object", Bucket=dest.bucket, Key=url.key)
        with answer["Body"] as body:
            data = io.BytesIO(body.read())
        wanted = None if columns is None else set(columns)
        if url.suffix == ".csv":
            yield pd.read_csv(
                data,
                usecols=None if wanted is None else wanted.__contains__,
                dtype=dict.fromkeys(text, str),
                keep_default_na=False,
            )
        else:
            names = pq.read_schema(data).names
            data.seek(0)
            kept = None if wanted is None else [n for n in names if n in wanted]
            yield pd.read_parquet(data, columns=kept)
