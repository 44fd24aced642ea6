"""Score Image Model on a Ray cluster: one job, Ray Data's tasks reading, its actors scoring.

The images' list is a dataset; reading, decoding and the inference transform run as tasks (the
same ``load_rgb`` and transform as one machine; an ``s3://`` prefix's objects fetched by the task
itself, with its node's keys); each actor holds one ONNX Runtime session (``threads`` cores each,
or a GPU each when the cluster has GPUs). The job is the runner of a sharded scoring
(:func:`~tasks.inference.score.shards.score_sharded`): rows come back in the images' order and
each missing shard's rows stream into its part as they come, written whole when its last row is
in (a local checkpoint table, or a part under the S3 prefix's ``_temporary``), so a stopped job
run again scores only the shards it lacks, and the table appears only when complete. An
interrupt (Ctrl-C, a cancelled flow run) stops the job whole (:mod:`tasks.cluster.job`).
Details: docs/scoring.md#on-a-cluster.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import socket
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.directory import ModelInfo
from tasks.cluster.connect import connect
from tasks.cluster.health import live_nodes
from tasks.cluster.job import stopped_whole
from tasks.cluster.node_settings import node_settings, runtime_env, server_settings
from tasks.cluster.placement import Placement, actor_slots
from tasks.data.imagedir import IMAGE_EXTENSIONS
from tasks.data.transform import input_size, per_batch_steps, transform_for
from tasks.inference.score.batches import LOGGER, checked_scoring, shard_bounds
from tasks.inference.score.images import ImageRef, applied_transform, list_images
from tasks.inference.score.readers import read_image
from tasks.inference.score.rows import BatchScorer, TableRows, scored_table
from tasks.inference.score.s3_table import part_suffix
from tasks.inference.score.session import batch_time_limit, check_model, inference_session
from tasks.inference.score.shards import SHARD_IMAGES, ShardedScoring, ShardJob, score_sharded
from tasks.inference.score.table import ERROR_COLUMN, table_schema
from tasks.shared import faults
from tasks.shared.errors import (
    ImageOpsError,
    NoUsableImagesError,
    ObjectStoreError,
    ScoringFailedError,
)
from tasks.shared.object_store import S3Url, s3_error, shared_client
from tasks.shared.settings import Settings
from tasks.shared.step import step, step_logger, tasks_on_first_use

CLUSTER_TIMEOUT_S = 60  # how long the cluster may take to answer, by default
# How long a stopped or failed job waits for Ray Data's executor to shut down (about 2.5 s when
# the actors answer) before it goes on without it.
EXECUTOR_STOP_S = 10.0


@dataclass(frozen=True)
class ClusterScoring:
    """One scoring of ``images`` with ``model`` into ``dest`` as a job on the cluster at
    ``cluster`` (host:port of its head); ``threads``: ONNX Runtime's cores per actor;
    ``shard_images``: the images of a part, the unit of resumption. ``images`` and ``dest`` may
    be ``s3://`` prefixes."""

    model: Path
    images: Path | S3Url
    dest: Path | S3Url
    cluster: str
    batch_size: int = 64
    threads: int | None = None  # default: 1 per actor, the other cores read
    quantized: bool = False
    timeout_s: int = CLUSTER_TIMEOUT_S
    shard_images: int = SHARD_IMAGES


def score_on_cluster(scoring: ClusterScoring) -> Path | S3Url:
    """:func:`~tasks.inference.score.shards.score_in_shards` as one job on a Ray cluster: the
    same table, the same parts and resumption (a part per ``shard_images`` images).

    Raises ClusterUnavailableError when the cluster does not answer within ``timeout_s``
    (nothing written), and the errors one-machine scoring raises (a model the actors cannot
    run: ScoringFailedError).
    """
    model = Path(scoring.model)
    images = scoring.images if isinstance(scoring.images, S3Url) else Path(scoring.images)
    dest = scoring.dest if isinstance(scoring.dest, S3Url) else Path(scoring.dest)
    table = dest if isinstance(dest, Path) else dest / f"part{part_suffix(dest)}"  # its parts'
    _, info, onnx_path = checked_scoring(
        model, table, scoring.batch_size, scoring.threads, scoring.quantized
    )
    check_model(inference_session(onnx_path, 1), info, onnx_path)  # refused before the cluster
    job = _Job(scoring, images, onnx_path, info, batch_time_limit())
    sharded = ShardedScoring(
        model, images, dest, scoring.shard_images, scoring.batch_size, scoring.threads,
        scoring.quantized,
    )  # fmt: skip
    with stopped_whole():
        return score_sharded(sharded, job.run)


@dataclass(frozen=True)
class _Job:
    """The runner of a sharded scoring's missing shards: all of them one Ray Data job."""

    scoring: ClusterScoring
    images: Path | S3Url
    onnx_path: Path
    info: ModelInfo
    time_limit: float

    def run(self, jobs: Sequence[ShardJob]) -> None:
        """Score ``jobs`` (shards, or the whole input straight into its table) as one job on the
        cluster, each written whole as soon as its last row is in (a ShardRunner)."""
        if not jobs:  # every shard was finished by a stopped run: nothing to ask the cluster
            return
        images, scoring = self.images, self.scoring
        refs, labeled = list_images(images)
        if not refs:
            raise NoUsableImagesError(
                f"No image found in {images}.",
                f"Scoring reads these extensions: {' '.join(IMAGE_EXTENSIONS)}.",
            )
        log = step_logger(LOGGER)
        transform = transform_for(
            self.info.transform, "inference", images, applied_transform(images)
        )
        connect(scoring.cluster, scoring.timeout_s, log)
        at_start = live_nodes()
        slices = [
            (0, len(refs)) if job.shard is None else shard_bounds(len(refs), *job.shard)
            for job in jobs
        ]
        wanted = np.concatenate([np.arange(first, last, dtype=np.int64) for first, last in slices])
        schema = table_schema(self.info.classes, labeled)
        scored, nodes = 0, {"read": collections.Counter(), "scored": collections.Counter()}
        # Closed at once when a part fails or the driver stops: the job's executor ends with it.
        with _closed_within(self.rows(refs, wanted, transform, log), log) as stream:
            pieces = _cut(stream, [last - first for first, last in slices])
            for index, rows in itertools.groupby(pieces, lambda piece: piece[0]):
                job = jobs[index]
                whole = job.shard is None
                with scored_table(job.dest, schema, images, whole, log) as table:
                    for batch in _counted((batch for _, batch in rows), nodes):
                        _write(table, batch, refs)
                scored += table.scored
                if job.shard is not None:
                    faults.point("score.shard_written", shard=job.shard[0], count=job.shard[1])
        by_node = "; ".join(
            f"{what} by node: " + ", ".join(f"{node} {n}" for node, n in sorted(count.items()))
            for what, count in nodes.items()
        )
        log.info(
            "Scored %d image(s) on the cluster at %s (%d not scored: see %s); %s",
            scored, scoring.cluster, len(wanted) - scored, ERROR_COLUMN, by_node,
        )  # fmt: skip
        alive = live_nodes()
        lost = sorted(name for node, name in at_start.items() if node not in alive)
        if lost:  # Ray Data ran their tasks and actors again on the others (see _Job.rows)
            log.warning(
                "Lost node(s) %s during the job: their images were read and scored again on "
                "the other nodes (%s)", ", ".join(lost), by_node,
            )  # fmt: skip

    def rows(
        self, refs: list[ImageRef], wanted: np.ndarray, transform: Any, log: Any
    ) -> Iterator[dict[str, Any]]:
        """The scored batches of the images ``wanted`` (places in ``refs``), in that order:
        ``id``, ``error``, ``probs``, ``label``."""
        import pyarrow as pa
        import ray
        import ray.data

        context = ray.data.DataContext.get_current()
        context.execution_options.preserve_order = True  # rows in the images' order
        # An actor's own error (ScoringFailedError), not Ray Data's UserCodeException, which
        # leaves it out when it crosses to the driver: _own_error finds it, and the user reads it
        # once, as the command's error line, without Ray Data's traceback of its own code.
        context.raise_original_map_exception = True
        for name in _REPORTS_FAILURES:
            logging.getLogger(name).addFilter(_not_our_error)
        context.enable_progress_bars = sys.stderr.isatty()  # a person watching, as on one machine
        context.print_on_execution_start = False
        logging.getLogger("ray.data._internal.progress").addFilter(_no_progress_bar_notice)
        scoring = self.scoring
        # Columns, not a dict per image: the driver's copy of the list stays small.
        items = pa.table(
            {
                "id": wanted,
                "rel": [refs[i].rel or refs[i].path for i in wanted],
                "problem": [refs[i].problem for i in wanted],
            }
        )
        size = -(-len(items) // max(1, min(len(items) // scoring.batch_size, 10_000)))
        gpus = int(ray.cluster_resources().get("GPU", 0))
        threads = scoring.threads or 1
        placement = Placement(actor_slots(ray.nodes(), threads))  # the other half of cores read
        actors = len(placement.slots)
        log.info(
            "Scoring %d image(s) with %s on the cluster at %s: %d actor(s) on %d node(s), %s each",
            len(items), self.onnx_path, scoring.cluster, actors, len(set(placement.slots)),
            "a GPU" if gpus else f"{threads} core(s)",
        )  # fmt: skip
        model = ray.put(self.onnx_path.read_bytes())
        settings = Settings()  # the driver's: the servers every node's tasks and actors use
        reading = {
            "root": self.images,  # once, not per image
            # split once here, not per batch, as the one-machine readers do
            "steps": per_batch_steps(transform),
            "side": input_size(self.info.transform),
            "servers": server_settings(settings),  # the S3 endpoint the tasks read from
        }
        # Ray 2.60 deprecates ray_remote_args_fn (to go in 2.64: ray is pinned) and offers
        # nothing else that gives each actor of a pool its own node.
        warnings.filterwarnings("ignore", message="`ray_remote_args_fn` is deprecated")
        dataset = (
            ray.data.from_arrow([items.slice(start, size) for start in range(0, len(items), size)])
            .map_batches(
                _read_batch, batch_size=scoring.batch_size, batch_format="numpy", fn_kwargs=reading
            )
            .map_batches(
                _Scorer,
                batch_size=scoring.batch_size,
                batch_format="numpy",
                fn_constructor_kwargs={
                    "model": [model],  # in a list: the actor gets the reference, not the bytes
                    "onnx_path": str(self.onnx_path),
                    "classes": self.info.classes,
                    "threads": threads,
                    "time_limit": self.time_limit,
                },
                # The servers' settings; and, the actors' own, it keeps the reading in tasks of
                # its own (Ray Data would fuse it into the actors: one core decoding per actor).
                runtime_env=runtime_env(settings),
                # A lost node's work is done again on the others: Ray Data restarts an actor
                # whose node died and resends its batches (max_restarts=-1, max_task_retries=-1:
                # its defaults), runs a lost read task again, and the driver, on a live node,
                # owns every block. Every actor from the start, each pinned to its node in turn
                # (tasks.cluster.placement): the pool grows only when batches queue up, which a
                # short job never saw (300 images on two hosts all went to one actor).
                compute=ray.data.ActorPoolStrategy(
                    min_size=1, max_size=actors, initial_size=actors
                ),
                ray_remote_args_fn=placement,
                # No core reserved: the pool's size already leaves half the cores to the read
                # tasks, and an actor restarted after its node died must not take the last core
                # the job's read tasks wait for (2 nodes of 2 cores, one lost: B's 2 cores went
                # to the 2 actors, the lost read tasks waited for ever).
                num_cpus=0,
                num_gpus=1 if gpus else 0,
            )
        )
        batches = dataset.iter_batches(batch_size=None, batch_format="numpy")
        try:
            yield from batches
        except Exception as exc:
            own = _own_error(exc)
            if own is None:
                raise
            raise own from None
        finally:
            with contextlib.suppress(Exception):
                batches.close()  # type: ignore[attr-defined]  # the executor shuts down


@contextlib.contextmanager
def _closed_within(
    stream: Iterator[dict[str, np.ndarray]], log: Any
) -> Iterator[Iterator[dict[str, np.ndarray]]]:
    """``stream``, closed on the way out by a thread waited for EXECUTOR_STOP_S at most.

    Closing it shuts Ray Data's executor down, which ends the job's tasks and actors; should
    that hang, a Ctrl-C or a cancelled flow run must still stop the job: the driver goes on and
    leaves the cluster (:func:`~tasks.cluster.job.stopped_whole`), which ends them all.
    """
    try:
        yield stream
    finally:
        closing = threading.Thread(
            target=_close_quietly, args=(stream,), daemon=True, name="ray-data-shutdown"
        )
        closing.start()
        closing.join(EXECUTOR_STOP_S)
        if closing.is_alive():
            log.warning(
                "Ray Data's executor did not shut down within %.0f s: going on without it",
                EXECUTOR_STOP_S,
            )


def _close_quietly(stream: Iterator[dict[str, np.ndarray]]) -> None:
    """Close ``stream``; its executor's own errors on the way down are not the job's."""
    faults.point("score.executor_shutdown")
    with contextlib.suppress(Exception):
        stream.close()  # type: ignore[attr-defined]


def _cut(
    batches: Iterator[dict[str, np.ndarray]], sizes: list[int]
) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """The stream of batches cut into consecutive runs of ``sizes`` rows: (the run's place, a
    piece of it), a piece at a time (a batch may end one run and start the next)."""
    pending: dict[str, np.ndarray] | None = None
    for index, size in enumerate(sizes):
        while size:
            if pending is None:
                pending = next(batches)
            taken = min(size, len(pending["id"]))
            yield index, {key: column[:taken] for key, column in pending.items()}
            rest = len(pending["id"]) - taken
            pending = {key: column[taken:] for key, column in pending.items()} if rest else None
            size -= taken


def _write(table: TableRows, batch: dict[str, np.ndarray], refs: list[ImageRef]) -> None:
    """Write a batch the actors scored as the table's rows."""
    ids, errors = batch["id"], [str(e) for e in batch["error"]]
    table.write(ids, [refs[i] for i in ids], errors, batch["probs"], batch["label"].astype(object))


def _counted(
    batches: Iterator[dict[str, np.ndarray]], nodes: dict[str, collections.Counter]
) -> Iterator[dict[str, np.ndarray]]:
    """``batches`` as they come, each one's rows counted under the nodes that read and scored
    them (the job's log says where its images went: every node, or which one took no part)."""
    for batch in batches:
        nodes["read"].update(str(node) for node in batch["reader"])
        nodes["scored"].update(str(node) for node in batch["scorer"])
        yield batch


def _read_batch(
    batch: dict[str, np.ndarray],
    root: Path | S3Url,
    steps: tuple[Any, Any],
    side: int,
    servers: dict[str, str],
) -> dict[str, np.ndarray]:
    """A Ray Data task: each image read and transformed, or its reason (a placeholder tensor).
    Images under an ``s3://`` root are fetched into memory here, from the driver's S3 server with
    this node's keys: when S3 refuses them or does not answer, the task fails (ObjectStoreError
    naming the node) instead of making every image an error row that a rerun would keep."""
    node_settings(servers)
    per_image, per_batch = steps  # each image's steps; the closing ones on the stacked batch
    tensors, errors = [], []
    for rel, problem in zip(batch["rel"], batch["problem"], strict=True):
        ref = ImageRef(root, str(rel), None, str(problem))
        tensor, error = read_image(ref, per_image)
        tensors.append(np.zeros((3, side, side), np.uint8) if tensor is None else tensor)
        errors.append(error)
    if isinstance(root, S3Url) and any(errors):
        _check_s3_answers(root)  # only then: a batch read whole costs no extra request
    return {
        "id": batch["id"],
        "error": np.asarray(errors, dtype=object),
        "tensor": per_batch(torch.from_numpy(np.stack(tensors))).numpy(),
        "reader": np.full(len(errors), socket.gethostname(), dtype=object),
    }


def _check_s3_answers(root: S3Url) -> None:
    """Raise ObjectStoreError naming this node when S3 does not take its keys for ``root``'s
    bucket or does not answer: its images' errors were the node's, not theirs."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        shared_client().head_bucket(Bucket=root.bucket)
    except (BotoCoreError, ClientError) as exc:
        error = s3_error(exc, "read", root)
        raise ObjectStoreError(
            f"{error.message} (on the cluster's node {socket.gethostname()})", error.hint
        ) from exc


class _Scorer:
    """A Ray Data actor: one ONNX Runtime session for the whole job, scoring batch after batch.

    A session this node cannot make (its ONNX Runtime, GPU or memory, where the driver's check
    passed) fails the actor's first batch with a ScoringFailedError naming the node: raised in
    the constructor, it would reach the driver as Ray's ActorDiedError, a text without our error.
    """

    def __init__(
        self,
        model: list[Any],
        onnx_path: str,
        classes: list[str],
        threads: int,
        time_limit: float,
    ) -> None:
        import ray

        self.failure: ScoringFailedError | None = None
        try:
            faults.point("score.actor_session", model=Path(onnx_path).parent.name)
            with tempfile.TemporaryDirectory(prefix="imageops-score-") as folder:
                local = Path(folder) / Path(onnx_path).name
                local.write_bytes(ray.get(model[0]))
                session = inference_session(local, threads)  # held in memory: the file may go
        except Exception as exc:
            why = exc.message if isinstance(exc, ImageOpsError) else f"{type(exc).__name__}: {exc}"
            self.failure = ScoringFailedError(
                f"The scoring actor on node {_this_node()} could not load {onnx_path}: {why[:300]}",
                "Check that node's ONNX Runtime (the project's lock on every machine: "
                "`make install`), its GPU and its free memory; or score on one machine "
                "(without --cluster).",
            )
            return
        self.scorer = BatchScorer(session, classes, time_limit, Path(onnx_path))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.failure is not None:
            raise self.failure
        errors = [str(e) for e in batch["error"]]
        kept = [i for i, error in enumerate(errors) if not error]
        probs, labels = self.scorer.scores(batch["tensor"][kept] if kept else None, kept, errors)
        return {
            "id": batch["id"],
            "error": np.asarray(errors, dtype=object),
            "probs": probs,
            "label": np.asarray(labels, dtype=object),
            "reader": batch["reader"],
            "scorer": np.full(len(errors), socket.gethostname(), dtype=object),
        }


def _this_node() -> str:
    """This Ray node as the cluster knows it (its address in `ray status`), and its host name."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    address = next(
        (n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id),
        ray.util.get_node_ip_address(),
    )
    return f"{address} ({socket.gethostname()})"


def _no_progress_bar_notice(record: logging.LogRecord) -> bool:
    """Drop Ray Data's "Progress bars disabled" notice: off on purpose where nobody watches."""
    return not record.getMessage().startswith("Progress bars disabled")


# Ray Data's loggers that report a failed task with a traceback of Ray Data's own code.
_REPORTS_FAILURES = (
    "ray.data.exceptions",
    "ray.data._internal.execution.streaming_executor_state",
)


def _not_our_error(record: logging.LogRecord) -> bool:
    """Drop Ray Data's report of a failure that is our own error: the driver raises it."""
    exc = record.exc_info[1] if record.exc_info else sys.exc_info()[1]
    return exc is None or _own_error(exc) is None


def _own_error(exc: BaseException) -> ImageOpsError | None:
    """Our error behind Ray Data's wrapping of a task's or actor's failure, if it is one."""
    seen: BaseException | None = exc
    while seen is not None:
        cause = getattr(seen, "cause", None)
        if isinstance(cause, ImageOpsError):
            return cause
        if isinstance(seen, ImageOpsError) and type(seen).__module__.startswith("tasks."):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


__getattr__ = tasks_on_first_use(
    globals(),
    score_on_cluster_task=lambda: step(score_on_cluster, name="score-on-cluster", retries=0),
)
