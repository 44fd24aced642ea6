"""Score Image Model: run a model's ``model.onnx`` over a folder of images, in batches.

The step in modules, one job each:

- ``images``: which images a scoring reads, in what order, under which names (:func:`list_images`).
- ``session``: the ONNX Runtime session (:func:`inference_session`) and its check against
  model.json.
- ``batches``: :func:`score`, one pass over the images a batch at a time, memory flat; an image
  that cannot be read becomes a row with its reason in ``Scoring Error``, never a failed batch.
- ``table``: the Score Image Model table's columns (:func:`table_schema`) and the merge of shard
  tables (:func:`merge_tables`).
- ``shards``: a large input cut into shards and merged in order (:func:`score_in_shards`); the
  shard is the unit of resumption, so a run killed mid-way and started again scores only the
  shards it had not finished. A flow runs the shards as parallel Prefect tasks
  (``flows.score.score_in_flow``).
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
