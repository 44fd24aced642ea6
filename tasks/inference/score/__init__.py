"""Score Image Model: run a model's ``model.onnx`` over a folder of images, in batches.

One job per module: ``images`` (what is read, in which order), ``session`` (ONNX Runtime),
``batches`` (one pass, memory flat; an unreadable image becomes a row with its reason), ``table``
(columns, merging shards), ``shards`` (the unit of resumption; a flow runs them as parallel tasks).
Details: docs/scoring.md#the-package.
"""

from tasks.inference.score.batches import score, score_task, shard_bounds
from tasks.inference.score.images import ImageRef, list_images
from tasks.inference.score.session import default_threads, inference_session
from tasks.inference.score.shards import (
    CHECKPOINT_FORMAT,
    CHECKPOINTS,
    SCRATCH,
    SHARD_IMAGES,
    ShardedScoring,
    ShardJob,
    checkpoint_dir,
    run_in_turn,
    score_in_shards,
    score_sharded,
)
from tasks.inference.score.table import (
    ERROR_COLUMN,
    LABEL_COLUMN,
    PROBABILITY_PREFIX,
    merge_tables,
    table_schema,
)

__all__ = [
    "CHECKPOINTS",
    "CHECKPOINT_FORMAT",
    "ERROR_COLUMN",
    "LABEL_COLUMN",
    "PROBABILITY_PREFIX",
    "SCRATCH",
    "SHARD_IMAGES",
    "ImageRef",
    "ShardJob",
    "ShardedScoring",
    "checkpoint_dir",
    "default_threads",
    "inference_session",
    "list_images",
    "merge_tables",
    "run_in_turn",
    "score",
    "score_in_shards",
    "score_sharded",
    "score_task",
    "shard_bounds",
    "table_schema",
]
