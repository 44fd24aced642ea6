"""The ONNX Runtime side of scoring: the session, its check against model.json, the softmax."""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidGraph, InvalidProtobuf

from models.directory import ModelInfo
from tasks.data.transform import input_size
from tasks.inference.export import META_CLASSES
from tasks.shared.errors import InvalidModelDirectoryError


def default_threads() -> int:
    """The cores this process may run on (the container's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64, shifted by the row maximum so no exponent overflows."""
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def check_model(session: ort.InferenceSession, info: ModelInfo, onnx_path: Path) -> None:
    """Refuse a model.json that does not describe this model.onnx, before any image is read."""
    (inp,) = session.get_inputs()
    (out,) = session.get_outputs()
    side = input_size(info.transform)
    hint = "Export the model again so model.onnx and model.json agree."
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
    if stored is not None and json.loads(stored) != list(info.classes):
        raise InvalidModelDirectoryError(
            f"model.json lists the classes {list(info.classes)}, but {onnx_path} was exported "
            f"for {json.loads(stored)} (in that order): its scores would get the wrong labels.",
            "Restore model.json's class list, or export the model again.",
        )
