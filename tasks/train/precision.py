"""Mixed precision and memory layout: how the training step computes, decided once per run.

The requested ``auto``/``fp32``/``bf16``/``fp16`` is resolved once per run and stored in its
config, so every rank, restart and resume trains in the same format. ``auto`` is decided from what
the hardware is, never from a timing (a timing on a busy machine gave fp32 one run and bf16 the
next: two models from one command): CPU: bf16 autocast where the CPU has native bf16 instructions
(AMX or AVX-512 BF16) and the input is large enough to gain from it, else fp32; fp16 refused.
CUDA: bf16 from compute capability 8.0, else fp16 with a GradScaler. Channels-last, except small
inputs on CPU. The run's log says what was chosen and why (:func:`precision_reason`).
Details: docs/precision.md#training-precision.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tasks.shared.errors import InvalidParameterError
from tasks.train.params import PRECISIONS, Resolved

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
# bf16 tensor cores arrived with Ampere (compute capability 8.0).
CUDA_BF16_CAPABILITY = (8, 0)
# Smallest input side trained in bf16 on CPU. Below it, the last ResNet stage convolves 1x1
# feature maps with stride 2, and oneDNN's bf16 weight gradient of such a convolution reads
# uninitialised memory for the kernel taps that only ever see padding (seen with torch 2.14.1:
# NaN in layer4.0.conv1.weight in up to half of the processes at 16 px; never at 24 or 32 px,
# where those maps are 2x2). The NaN hides from the training loss (oneDNN's forward skips the
# padding) and shows up at scoring; loop.check_weights stops a run where it appears anyway.
MIN_CPU_BF16_INPUT = 32
# Smallest input side that trains in bf16 (under ``auto``) and channels-last on CPU. Below it a
# step is mostly per-layer overhead, not arithmetic, and plain NCHW float32 is the fastest:
# the training-step benchmark (bench/train_speed.py) at sizes S on 2 cores gave our step in bf16
# channels-last at 0.68x the plain loop at 32 px, 1.16x at 64 px, 2.16x at 224 px (issue 4's
# run, docs/benchmarks.md).
CPU_FAST_PATH_INPUT = 64
ASKED = "asked for"  # the reason when the request named the format


def resolve_precision(requested: str, device: str, input_size: int | None = None) -> Resolved:
    """The format a run on ``device`` ("cpu" or "cuda") trains in when ``requested`` is asked.

    ``input_size``: the side of the network's input in pixels (None: not known, taken as large).
    :func:`precision_choice` without its reason.
    """
    return precision_choice(requested, device, input_size)[0]


def precision_choice(
    requested: str, device: str, input_size: int | None = None
) -> tuple[Resolved, str]:
    """The format a run on ``device`` trains in when ``requested`` is asked, and why (for its log).

    ``auto`` on CPU: bf16 where the CPU has native bf16 instructions (:func:`cpu_bf16_feature`)
    and the input is at least ``CPU_FAST_PATH_INPUT``, else fp32; on CUDA: bf16 from compute
    capability 8.0, else fp16. Only what the hardware is decides, never a timing: the same
    command on the same machine trains in the same format. Raises InvalidParameterError for a
    format the device cannot train in (which: docs/precision.md#resolve_precision).
    """
    if requested not in PRECISIONS:
        raise InvalidParameterError(
            f"precision = {requested!r}, expected one of {', '.join(map(repr, PRECISIONS))}."
        )
    if requested == "fp32":
        return "fp32", ASKED
    if device == "cuda":
        return _resolve_cuda(requested)
    if requested == "fp16":
        raise InvalidParameterError(
            "precision = 'fp16' is for CUDA GPUs; it cannot train on CPU (float16 is emulated "
            "on CPUs, and its loss scaling is a GPU feature).",
            "Use precision='bf16' or 'auto' on CPU (bfloat16 where the CPU supports it), or "
            "'fp32'.",
        )
    if requested == "bf16":
        if input_size is not None and input_size < MIN_CPU_BF16_INPUT:
            raise InvalidParameterError(
                f"precision = 'bf16' on CPU needs inputs of at least {MIN_CPU_BF16_INPUT} px; "
                f"this transform gives {input_size} px, where the CPU's bf16 convolution "
                "gradients of the last stage are unreliable.",
                "Use precision='auto' or 'fp32', or a larger center crop.",
            )
        if not cpu_bf16_runs():
            raise InvalidParameterError(
                "precision = 'bf16', but bfloat16 autocast does not run on this CPU.",
                "Use precision='auto' or 'fp32'.",
            )
        return "bf16", ASKED
    if input_size is not None and input_size < CPU_FAST_PATH_INPUT:
        return "fp32", (
            f"inputs of {input_size} px, under {CPU_FAST_PATH_INPUT}: float32 is faster there"
        )
    feature = cpu_bf16_feature()
    if feature is None:
        return "fp32", "CPU has neither AMX nor AVX-512 BF16: bfloat16 would be emulated, slower"
    if not cpu_bf16_runs():
        return "fp32", f"CPU has {feature}, but this PyTorch's bfloat16 autocast does not run"
    return "bf16", f"CPU has {feature}"


def precision_reason(requested: str, resolved: Resolved, device: str, input_size: int) -> str:
    """Why a run asked ``requested`` trains in ``resolved`` here: the reason
    :func:`precision_choice` gives, or, when this machine would choose otherwise (a resume on
    another machine), that the run keeps what it chose when it started."""
    if requested != "auto":
        return ASKED
    chosen, reason = precision_choice(requested, device, input_size)
    if chosen == resolved:
        return reason
    return f"chosen when the run started and kept; here auto would give {chosen}: {reason}"


def _resolve_cuda(requested: str) -> tuple[Resolved, str]:
    # The launcher runs this: get_device_capability only reads device properties, and no tensor
    # is made on the GPU, so the launcher takes no GPU memory from its workers.
    oldest = min(torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))
    has_bf16 = oldest >= CUDA_BF16_CAPABILITY
    capability = f"compute capability {oldest[0]}.{oldest[1]}"
    if requested == "bf16" and not has_bf16:
        raise InvalidParameterError(
            f"precision = 'bf16' needs a GPU of compute capability 8.0 or newer; this one is "
            f"{oldest[0]}.{oldest[1]}.",
            "Use precision='fp16' (with loss scaling) or 'auto' on this GPU.",
        )
    if requested == "auto":
        if has_bf16:
            return "bf16", f"GPU of {capability}, 8.0 or newer: bf16 tensor cores"
        return "fp16", f"GPU of {capability}, older than 8.0: float16 with loss scaling"
    return ("bf16" if requested == "bf16" else "fp16"), ASKED


@functools.cache
def cpu_bf16_feature() -> str | None:
    """The CPU's native bfloat16 instructions as the run's log names them ("AMX", "avx512_bf16"),
    or None where it has neither (PyTorch would emulate bf16, slower than float32). Read from
    the CPU's feature flags through PyTorch (x86 only; other CPUs get None)."""
    checks = {"AMX": "_is_amx_tile_supported", "avx512_bf16": "_is_avx512_bf16_supported"}
    for name, check in checks.items():
        supported = getattr(torch.cpu, check, None)
        if supported is not None and supported():
            return name
    return None


@functools.cache
def cpu_bf16_runs() -> bool:
    """Whether a convolution under bfloat16 autocast runs on this CPU and gives a finite bf16
    result: a check of the kernels, not a timing. Cached: once per process. The global random
    state is left as it was."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(2, 8, 8, 8, generator=generator)
    weight = torch.randn(8, 8, 3, 3, generator=generator)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            probe = F.conv2d(images, weight, padding=1)
    except RuntimeError:  # no bf16 kernel for this CPU or build
        return False
    return probe.dtype == torch.bfloat16 and bool(torch.isfinite(probe.float()).all())


@dataclass(frozen=True)
class Amp:
    """How one training step computes: autocast dtype, gradient scaler and memory layout."""

    device_type: str
    precision: Resolved
    channels_last: bool = True

    @classmethod
    def for_run(cls, device_type: str, precision: Resolved, input_size: int) -> Amp:
        """The settings of a run: channels-last on GPU, and on CPU from ``CPU_FAST_PATH_INPUT``
        pixels (below, NCHW, which is faster there)."""
        small = device_type == "cpu" and input_size < CPU_FAST_PATH_INPUT
        return cls(device_type, precision, channels_last=not small)

    @property
    def memory_format(self) -> torch.memory_format:
        """The layout of the model's weights and of every batch."""
        return torch.channels_last if self.channels_last else torch.contiguous_format

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype, or None for float32 (no autocast)."""
        return DTYPES.get(self.precision)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The forward pass runs in here: convolutions and matmuls in the low-precision dtype."""
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None):
            yield

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A scaler that is active for float16 on CUDA and a pass-through otherwise.

        Using one (possibly disabled) scaler keeps a single code path in the training step and a
        single ``scaler`` entry in the checkpoint.
        """
        enabled = self.precision == "fp16" and self.device_type == "cuda"
        return torch.amp.GradScaler(self.device_type, enabled=enabled)
