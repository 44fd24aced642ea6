"""This machine's GPUs, lent to the tuning trials that run on it: each GPU to one trial at a time.

A CUDA trial takes ``nproc_per_node`` GPUs as its torchrun's ``CUDA_VISIBLE_DEVICES`` until it ends,
however it ends; trials wait in order while too few are free, and one needing more than the machine
has is refused. GPUs are named as in this process's ``CUDA_VISIBLE_DEVICES``; each process lends
only its own. Details: docs/tuning.md#gpus.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections import deque
from collections.abc import Iterator, Sequence

import torch

from tasks.shared.errors import InvalidTuningSpecError
from tasks.train.params import TrainParams
from tasks.tune.spec import TuningSpec, Value

VISIBLE = "CUDA_VISIBLE_DEVICES"


class GpuSlots:
    """The GPUs to lend, by the names ``CUDA_VISIBLE_DEVICES`` gives them; thread-safe."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = tuple(devices)
        self._free = list(self.devices)
        self._turns: deque[object] = deque()  # trials waiting, first come first served
        self._changed = threading.Condition()

    @classmethod
    def visible(cls) -> GpuSlots:
        """The GPUs this process sees (torch's count; the names from CUDA_VISIBLE_DEVICES)."""
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return cls(device_names(count, os.environ.get(VISIBLE)))

    def __len__(self) -> int:
        return len(self.devices)

    @property
    def free(self) -> int:
        with self._changed:
            return len(self._free)

    @contextlib.contextmanager
    def take(self, count: int, who: str = "a trial") -> Iterator[tuple[str, ...]]:
        """Hold ``count`` GPUs (waiting for them) while the block runs; their names.

        0 takes none and never waits. More than the machine has is refused with
        InvalidTuningSpecError. The GPUs come back when the block ends, also by an exception.
        """
        if count == 0:
            yield ()
            return
        if count > len(self.devices):
            raise InvalidTuningSpecError(
                f"{who} needs {_gpus(count)}, and this machine has {len(self.devices)}.",
                _fewer_gpus_hint(len(self.devices)),
            )
        turn = object()
        with self._changed:
            self._turns.append(turn)
            try:
                while self._turns[0] is not turn or len(self._free) < count:
                    self._changed.wait()
            finally:
                self._turns.remove(turn)
                self._changed.notify_all()  # the next in line may now be first
            taken = tuple(self._free[:count])
            del self._free[:count]
        try:
            yield taken
        finally:
            with self._changed:
                self._free = [d for d in self.devices if d in self._free or d in taken]
                self._changed.notify_all()


def device_names(count: int, visible: str | None) -> list[str]:
    """Names for the ``count`` GPUs torch sees, as ``visible`` (CUDA_VISIBLE_DEVICES) gave them.

    A trial's own CUDA_VISIBLE_DEVICES must name the same devices; torch's numbering when unset.
    """
    names = [n.strip() for n in (visible or "").split(",") if n.strip()]
    if len(names) < count:  # not set, or not as torch read it
        names = [str(i) for i in range(count)]
    return names[:count]


@functools.cache
def local_gpus() -> GpuSlots:
    """This process's GPUs, shared by every trial it runs."""
    return GpuSlots.visible()


def check_study_gpus(spec: TuningSpec, slots: GpuSlots) -> None:
    """Refuse, before any trial runs here, a study whose trials need more GPUs than ``slots``."""
    need, device = most_gpus(spec, len(slots))
    if need > len(slots):
        raise InvalidTuningSpecError(
            f"Trials of this study may train with device = {device!r} and nproc_per_node = "
            f"{need}: {_gpus(need)} each, and this machine has {len(slots)} "
            "(CUDA_VISIBLE_DEVICES counted).",
            _fewer_gpus_hint(len(slots)),
        )


def most_gpus(spec: TuningSpec, visible: int) -> tuple[int, str]:
    """The most GPUs one trial of ``spec`` may take (``visible`` GPUs here), and its device.

    From the values each of device and nproc_per_node may take (tuned, or train's); tuned
    nproc_per_node values that only apply under CPU devices (a child of device) do not count.
    """
    tuned = spec.by_name()

    def possible(name: str) -> list[Value]:
        own = getattr(spec.train, name)
        param = tuned.get(name)
        if param is None:
            return [own]
        values: list[Value] = list(param.values or []) if param.max is None else [int(param.max)]
        return values if param.parent is None else [*values, own]

    most, where = 0, "cpu"
    nproc = tuned.get("nproc_per_node")
    for device in possible("device"):
        if device != "cuda" and not (device == "auto" and visible > 0):
            continue
        counts = possible("nproc_per_node")
        if (
            nproc is not None
            and nproc.parent == "device"
            and device not in (nproc.parent_values or [])
        ):
            counts = [spec.train.nproc_per_node]
        need = max(int(c) for c in counts)
        if need > most:
            most, where = need, str(device)
    return most, where


def _gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


def _fewer_gpus_hint(gpus: int) -> str:
    if gpus:
        return (
            f"Use at most {gpus} processes per trial on GPU (nproc_per_node, in train or its "
            "range), or run trials on a work pool of bigger machines (trial_deployment)."
        )
    return (
        "Train on CPU (device: cpu or auto), or run trials on a work pool of GPU machines "
        "(trial_deployment)."
    )


def gpus_for(params: TrainParams, visible: int) -> int:
    """GPUs a trial with ``params`` trains on here: the device as the launcher resolves it."""
    on_gpu = params.device == "cuda" or (params.device == "auto" and visible > 0)
    return params.nproc_per_node if on_gpu else 0


def gpu_environment(gpus: Sequence[str]) -> dict[str, str]:
    """The trial's torchrun environment for its GPUs (none for a CPU trial)."""
    return {VISIBLE: ",".join(gpus)} if gpus else {}
