"""Score Image Model: run a model's ``model.onnx`` over a folder of images, in batches.

One job per module: ``images`` (what is read, in which order), ``session`` (ONNX Runtime),
``readers`` (decoding in reader processes), ``batches`` (one pass, memory flat; an unreadable
image becomes a row with its reason), ``table`` (columns, merging shards), ``shards`` (the unit
of resumption; a flow runs them as parallel tasks), ``rows`` (a batch's scores as rows),
``on_cluster`` (one job over a Ray cluster with Ray Data), ``s3_images`` and ``s3_table`` (images
and the table under an ``s3://`` prefix). Details: docs/scoring.md#the-package.
"""

from importlib import import_module
from typing import Any

# What the package offers -> the module that has it. Imported on first use: the table's columns
# (evaluate) need neither ONNX Runtime nor torch, and the tasks need Prefect.
_WHERE = {
    "score": "batches",
    "score_task": "batches",
    "shard_bounds": "batches",
    "ClusterScoring": "on_cluster",
    "score_on_cluster": "on_cluster",
    "score_on_cluster_task": "on_cluster",
    "ImageRef": "images",
    "list_images": "images",
    "default_threads": "session",
    "inference_session": "session",
    "sessions_reused": "session",
    "CHECKPOINT_FORMAT": "shards",
    "CHECKPOINTS": "shards",
    "SCRATCH": "shards",
    "SHARD_IMAGES": "shards",
    "ShardedScoring": "shards",
    "ShardJob": "shards",
    "checkpoint_dir": "shards",
    "run_in_turn": "shards",
    "score_in_shards": "shards",
    "score_sharded": "shards",
    "ERROR_COLUMN": "table",
    "LABEL_COLUMN": "table",
    "PROBABILITY_PREFIX": "table",
    "merge_tables": "table",
    "table_schema": "table",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    return value


__all__ = sorted(_WHERE)
