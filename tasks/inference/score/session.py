"""The ONNX Runtime side of scoring: the session, its check against model.json, one batch's run
(time-limited), the softmax and the scores it refuses."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import (
    EPFail,
    Fail,
    InvalidArgument,
    InvalidGraph,
    InvalidProtobuf,
    RuntimeException,
)

from models.directory import ModelInfo
from tasks.data.transform import input_size
from tasks.inference.export import INPUT_NAME, META_CLASSES, OUTPUT_NAME
from tasks.shared.errors import (
    InvalidModelDirectoryError,
    InvalidParameterError,
    ScoringFailedError,
)

BATCH_TIME_LIMIT = "IMAGEOPS_SCORE_BATCH_TIMEOUT_S"  # seconds one batch may run in ONNX Runtime
DEFAULT_BATCH_SECONDS = 600.0
NON_FINITE = "NonFiniteScores"  # the reason of a row whose scores are NaN or infinite


def default_threads() -> int:
    """The cores this process may run on (the container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def runs_at_once(threads: int) -> int:
    """Batches one session scores at once, each on ``threads // runs`` threads: two on a CPU with
    two threads or more, one on a GPU (the device runs one batch at a time anyway).

    A rule, not a timing taken at run time; measured beside the readers on 2 cores
    (docs/scoring.md#readers): end to end over ONNX Runtime alone, interleaved with the old way,
    64 px 0.68x -> 0.81x and 224 px 0.83x -> 0.88x (medians; docs/benchmarks.md).
    """
    if threads < 2 or "CUDAExecutionProvider" in ort.get_available_providers():
        return 1
    return 2


@functools.cache
def _load_cuda_libraries() -> None:
    """CUDA and cuDNN from the nvidia-* wheels torch brought (or torch's own), once per process,
    as ORT's docs advise for pip installs: no LD_LIBRARY_PATH needed. ORT falls back to the CPU
    if the GPU cannot be used (no device, too old a driver) and says so in a warning."""
    ort.preload_dlls()


# The sessions of a :func:`sessions_reused` block, by model file and threads; None outside one.
_REUSED: ContextVar[dict[tuple, ort.InferenceSession] | None] = ContextVar(
    "imageops_reused_sessions", default=None
)


@contextlib.contextmanager
def sessions_reused() -> Iterator[None]:
    """Inside the block, :func:`inference_session` hands out one session per model file.

    Scoring shards one after another made a session per shard, and each left its share of the
    heap behind (ORT frees its arena, the allocator keeps the pages): 10 shards peaked 108 MB above
    one; with one session, 1 MB (docs/benchmarks.md, "Data at scale"). Closed with the block.
    """
    token = _REUSED.set({})
    try:
        yield
    finally:
        _REUSED.reset(token)


def inference_session(onnx_path: Path, threads: int | None = None) -> ort.InferenceSession:
    """An ONNX Runtime session tuned for batch scoring (the block's own in :func:`sessions_reused`).

    All graph optimisations; intra-op threads = the cores we may use (ORT's default can count the
    host's cores inside a container); CUDA first when this onnxruntime build has it (the worker
    image installs onnxruntime-gpu), CPU always as the fallback. Details: docs/scoring.md#on-a-gpu.
    """
    reused = _REUSED.get()
    if reused is None:
        return _new_session(onnx_path, threads)
    stat = os.stat(onnx_path)  # a file rewritten inside the block is another model
    key = (os.path.realpath(onnx_path), stat.st_ino, stat.st_size, stat.st_mtime_ns, threads)
    if key not in reused:
        reused[key] = _new_session(onnx_path, threads)
    return reused[key]


def _new_session(onnx_path: Path, threads: int | None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = threads or default_threads()
    providers = ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" in ort.get_available_providers():  # the onnxruntime-gpu build
        providers.insert(0, "CUDAExecutionProvider")
        _load_cuda_libraries()
    try:
        return ort.InferenceSession(str(onnx_path), sess_options=options, providers=providers)
    except (InvalidProtobuf, InvalidGraph, Fail) as exc:  # truncated, edited, not ONNX at all
        raise InvalidModelDirectoryError(
            f"{onnx_path} is not a readable ONNX model ({type(exc).__name__}: "
            f"{str(exc)[:200]}): the file is truncated or damaged.",
            "Export the model again (imageops export), or for a registered model delete its "
            "cached folder so the next run downloads it again.",
        ) from None


def batch_time_limit() -> float:
    """Seconds one batch may take in ONNX Runtime: ``IMAGEOPS_SCORE_BATCH_TIMEOUT_S``, read when a
    scoring starts (a bad value is refused before any image is read), else 600."""
    value = os.environ.get(BATCH_TIME_LIMIT, "").strip()
    if not value:
        return DEFAULT_BATCH_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidParameterError(
            f"{BATCH_TIME_LIMIT} = {value[:40]!r}, expected a number of seconds above 0.",
            f"Unset it (the default is {DEFAULT_BATCH_SECONDS:g} s) or set e.g. "
            f"{BATCH_TIME_LIMIT}=1200.",
        )
    return seconds


def run_batch(
    session: ort.InferenceSession, batch: np.ndarray, classes: int, seconds: float, onnx_path: Path
) -> np.ndarray:
    """The model's logits for ``batch``, one row of ``classes`` scores per image.

    A model.onnx can fail at run time (a hostile one asks for petabytes) or never finish (a Loop
    of 2^62 iterations): either is a ScoringFailedError, never a traceback or a hang. A timer
    sets ONNX Runtime's ``RunOptions.terminate`` after ``seconds``, which stops the run between
    nodes and between a loop's iterations.
    """
    options = ort.RunOptions()
    options.log_severity_level = 4  # the error raised below says it; ORT's log line would repeat
    timer = threading.Timer(seconds, setattr, (options, "terminate", True))
    timer.daemon = True
    timer.start()
    try:
        (logits,) = session.run([OUTPUT_NAME], {INPUT_NAME: batch}, options)
    except (Fail, RuntimeException, InvalidArgument, EPFail) as exc:
        if options.terminate:
            raise ScoringFailedError(
                f"{onnx_path} ran past the time limit of {seconds:g} s on a batch of "
                f"{len(batch)} image(s) and was stopped.",
                f"A model this slow: set {BATCH_TIME_LIMIT} higher (seconds) or --batch-size "
                "lower. A model that never finishes (an endless loop) must be exported again.",
            ) from None
        raise ScoringFailedError(
            f"ONNX Runtime failed running {onnx_path} on a batch of {len(batch)} image(s): "
            f"{_cut(str(exc).strip())}",
            "If memory ran out, score with a smaller --batch-size; otherwise export the model "
            "again (imageops export): this model.onnx cannot score images.",
        ) from None
    finally:
        timer.cancel()
    if logits.shape != (len(batch), classes):
        raise ScoringFailedError(
            f"{onnx_path} returned scores of shape {list(logits.shape)} for a batch of "
            f"{len(batch)} image(s) and {classes} classes.",
            "Export the model again (imageops export): this model.onnx cannot score images.",
        )
    return logits


def unusable_scores(logits: np.ndarray) -> list[str]:
    """Each row's reason its scores cannot give a label ("" for a usable row).

    A NaN's argmax is class 0 and an infinite score's softmax is NaN: scored as they are, such
    rows would get a label nothing supports, so each becomes an error row saying why.
    """
    reasons = np.full(len(logits), "", dtype=object)
    reasons[np.isinf(logits).any(axis=1)] = f"{NON_FINITE}: the model returned an infinite score"
    reasons[np.isnan(logits).any(axis=1)] = f"{NON_FINITE}: the model returned NaN"
    return reasons.tolist()


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64, shifted by the row maximum so no exponent overflows."""
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def check_model(session: ort.InferenceSession, info: ModelInfo, onnx_path: Path) -> None:
    """Refuse a model.onnx that scoring cannot feed, or a model.json that does not describe it,
    before any image is read."""
    hint = "Export the model again so model.onnx and model.json agree."
    inputs, outputs = session.get_inputs(), session.get_outputs()
    takes = [f"{i.name} ({i.type})" for i in inputs]
    gives = [o.name for o in outputs]
    if takes != [f"{INPUT_NAME} (tensor(float))"] or gives != [OUTPUT_NAME]:
        raise InvalidModelDirectoryError(
            f"{onnx_path} takes the inputs {takes[:10]} and returns {gives[:10]}; scoring feeds "
            f"one float tensor named {INPUT_NAME!r} and reads one named {OUTPUT_NAME!r}.",
            "Export the model with imageops export: a model.onnx made otherwise cannot be scored.",
        )
    (inp,), (out,) = inputs, outputs
    side = input_size(info.transform)
    if inp.shape[1:] != [3, side, side]:
        raise InvalidModelDirectoryError(
            f"{onnx_path} takes input {inp.shape}, but model.json's transform makes "
            f"{side}x{side} images.",
            hint,
        )
    if out.shape[-1] != len(info.classes):
        raise InvalidModelDirectoryError(
            f"{onnx_path} returns {out.shape[-1]} scores, but model.json lists "
            f"{len(info.classes)} classes.",
            hint,
        )
    # The exporter writes the class list into the model too: a model.json whose list was
    # reordered or renamed would otherwise label every score with another class.
    stored = session.get_modelmeta().custom_metadata_map.get(META_CLASSES)
    if stored is None:
        return
    try:
        exported_for = json.loads(stored)
    except (ValueError, RecursionError):  # not JSON, or nested beyond the parser's depth
        exported_for = None
    if not isinstance(exported_for, list):
        raise InvalidModelDirectoryError(
            f"{onnx_path}'s class list ({META_CLASSES!r} in its metadata) is not a JSON list: "
            f"{stored[:80]!r}.",
            "Export the model again (imageops export): the class list it writes decides which "
            "label each score gets.",
        )
    if exported_for != list(info.classes):
        raise InvalidModelDirectoryError(
            f"model.json lists the classes {_shown(list(info.classes))}, but {onnx_path} was "
            f"exported for {_shown(exported_for)} (in that order): its scores would get the "
            "wrong labels.",
            "Restore model.json's class list, or export the model again.",
        )


def _cut(text: str) -> str:
    """ONNX Runtime's message, its head (which node) and tail (what failed) when it is long."""
    return text if len(text) <= 400 else f"{text[:200]} ... {text[-200:]}"


def _shown(classes: list) -> str:
    """A class list as a message shows it: cut short, however long the list is."""
    text = repr(classes)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(classes)} classes)"
