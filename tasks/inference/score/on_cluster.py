"""Score Image Model on a Ray cluster: one job, Ray Data's tasks reading, its actors scoring.

The image list is a dataset; reading, decoding and the inference transform run as tasks (the
same ``load_rgb`` and transform as one machine); each actor holds one ONNX Runtime session
(``threads`` cores each, or a GPU each when the cluster has GPUs). Rows come back in the images'
order and stream into the same table as :func:`~tasks.inference.score.batches.score` writes:
every image one row, an unreadable one with its reason. An interrupt (Ctrl-C, a cancelled flow
run) stops the job whole (:mod:`tasks.cluster.job`). The images must be where every node reads
them at the same path. Details: docs/scoring.md#on-a-cluster.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.atomic import atomic_file
from tasks.cluster.connect import connect
from tasks.cluster.job import stopped_whole
from tasks.cluster.node_settings import runtime_env
from tasks.data.imagedir import IMAGE_EXTENSIONS
from tasks.data.transform import applied_to, input_size, transform_for
from tasks.inference.score.batches import LOGGER, checked_scoring
from tasks.inference.score.images import ImageRef, list_images
from tasks.inference.score.readers import read_image
from tasks.inference.score.rows import BatchScorer, table_rows
from tasks.inference.score.session import batch_time_limit, check_model, inference_session
from tasks.inference.score.table import ERROR_COLUMN, NOT_SCORED_HINT, table_schema
from tasks.shared import faults
from tasks.shared.errors import ImageOpsError, NoUsableImagesError, ScoringFailedError
from tasks.shared.settings import Settings
from tasks.shared.step import step, step_logger, tasks_on_first_use

CLUSTER_TIMEOUT_S = 60  # how long the cluster may take to answer, by default


@dataclass(frozen=True)
class ClusterScoring:
    """One scoring of ``images`` with ``model`` into ``dest`` as a job on the cluster at
    ``cluster`` (host:port of its head); ``threads``: ONNX Runtime's cores per actor."""

    model: Path
    images: Path
    dest: Path
    cluster: str
    batch_size: int = 64
    threads: int | None = None  # default: 1 per actor, the other cores read
    quantized: bool = False
    timeout_s: int = CLUSTER_TIMEOUT_S


def score_on_cluster(scoring: ClusterScoring) -> Path:
    """:func:`~tasks.inference.score.batches.score` as one job on a Ray cluster: the same table.

    Raises ClusterUnavailableError when the cluster does not answer within ``timeout_s``
    (nothing written), and the errors one-machine scoring raises (a model the actors cannot
    run: ScoringFailedError).
    """
    model, images, dest = Path(scoring.model), Path(scoring.images), Path(scoring.dest)
    table, info, onnx_path = checked_scoring(
        model, dest, scoring.batch_size, scoring.threads, scoring.quantized
    )
    time_limit = batch_time_limit()
    check_model(inference_session(onnx_path, 1), info, onnx_path)  # refused before the cluster
    refs, labeled = list_images(images)
    if not refs:
        raise NoUsableImagesError(
            f"No image found in {images}.",
            f"Scoring reads these extensions: {' '.join(IMAGE_EXTENSIONS)}.",
        )
    log = step_logger(LOGGER)
    transform = transform_for(info.transform, "inference", images, applied_to(images))
    connect(scoring.cluster, scoring.timeout_s, log)
    job = _Job(scoring, onnx_path, info.classes, time_limit, input_size(info.transform))
    schema = table_schema(info.classes, labeled)
    scored = 0
    with stopped_whole(), atomic_file(dest) as tmp:
        writer = table.writer(tmp, schema)
        try:
            for batch in job.rows(refs, transform, log):
                ids = batch["id"]
                errors = [str(e) for e in batch["error"]]
                for i, error in zip(ids, errors, strict=True):
                    if error:
                        log.warning("Cannot score %s: %s", refs[i].path, error)
                data = {
                    "id": ids.astype(np.int64),
                    "path": [refs[i].path for i in ids],
                    "category": [refs[i].category for i in ids],
                    ERROR_COLUMN: errors,
                }
                labels = batch["label"].astype(object)
                writer.write(table_rows(data, batch["probs"], labels, schema.names))
                scored += sum(1 for e in errors if not e)
        finally:
            writer.close()
        if not scored:
            raise NoUsableImagesError(
                f"None of the {len(refs)} image(s) in {images} could be scored.",
                NOT_SCORED_HINT,
            )
    log.info(
        "Scored %d image(s) on the cluster at %s into %s (%d not scored: see %s)",
        scored, scoring.cluster, dest, len(refs) - scored, ERROR_COLUMN,
    )  # fmt: skip
    return dest


@dataclass(frozen=True)
class _Job:
    scoring: ClusterScoring
    onnx_path: Path
    classes: list[str]
    time_limit: float
    side: int  # the network's input side: an unreadable image's placeholder tensor

    def rows(self, refs: list[ImageRef], transform: Any, log: Any) -> Iterator[dict[str, Any]]:
        """The scored batches, in the images' order: ``id``, ``error``, ``probs``, ``label``."""
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
        items = [
            {"id": i, "root": str(r.root), "rel": r.rel or r.path, "problem": r.problem}
            for i, r in enumerate(refs)
        ]
        blocks = max(1, min(len(items) // scoring.batch_size, 10_000))
        gpus = int(ray.cluster_resources().get("GPU", 0))
        threads = scoring.threads or 1
        cpus = int(ray.cluster_resources().get("CPU", 1))
        actors = gpus or max(1, cpus // (2 * threads))  # the other half of the cores read
        log.info(
            "Scoring %d image(s) with %s on the cluster at %s: %d actor(s), %s each",
            len(items), self.onnx_path, scoring.cluster, actors,
            "a GPU" if gpus else f"{threads} core(s)",
        )  # fmt: skip
        model = ray.put(self.onnx_path.read_bytes())
        dataset = (
            ray.data.from_items(items, override_num_blocks=blocks)
            .map_batches(
                _read_batch,
                batch_size=scoring.batch_size,
                batch_format="numpy",
                fn_kwargs={"transform": transform, "side": self.side},
            )
            .map_batches(
                _Scorer,
                batch_size=scoring.batch_size,
                batch_format="numpy",
                fn_constructor_kwargs={
                    "model": [model],  # in a list: the actor gets the reference, not the bytes
                    "onnx_path": str(self.onnx_path),
                    "classes": self.classes,
                    "threads": threads,
                    "time_limit": self.time_limit,
                },
                # The servers' settings; and, the actors' own, it keeps the reading in tasks of
                # its own (Ray Data would fuse it into the actors: one core decoding per actor).
                runtime_env=runtime_env(Settings()),
                compute=ray.data.ActorPoolStrategy(min_size=1, max_size=actors),
                num_cpus=0 if gpus else threads,
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


def _read_batch(batch: dict[str, np.ndarray], transform: Any, side: int) -> dict[str, np.ndarray]:
    """A Ray Data task: each image read and transformed, or its reason (a placeholder tensor)."""
    tensors, errors = [], []
    for root, rel, problem in zip(batch["root"], batch["rel"], batch["problem"], strict=True):
        ref = ImageRef(Path(root), str(rel), None, str(problem))
        tensor, error = read_image(ref, transform)
        tensors.append(np.zeros((3, side, side), np.float32) if tensor is None else tensor)
        errors.append(error)
    return {
        "id": batch["id"],
        "error": np.asarray(errors, dtype=object),
        "tensor": np.stack(tensors),
    }


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
