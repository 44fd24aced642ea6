"""Distributed set-up in one place: the same worker runs under torchrun or as a plain process.

torchrun sets ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``; without them this is a world of one and
every collective below is the identity, so the training code never branches on "am I
distributed?". CPU runs use gloo and CUDA runs NCCL, both with a short explicit timeout: the default
(30 minutes) would leave a crashed peer's partners hanging for half an hour.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Longest gap allowed between two collectives: rank 0 writing a checkpoint, the model directory
# or MLflow records while the others wait at a barrier. Generous for that, short next to 30 min.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


_info: DistInfo | None = None


def setup(device: str) -> DistInfo:
    """Read torchrun's variables, pick the device and join the process group (if world > 1).

    ``device`` is "cpu" or "cuda"; on CUDA each process takes the GPU of its local rank.
    """
    global _info
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        torch_device = torch.device("cuda", local_rank)
    else:
        torch_device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device == "cuda" else "gloo",
            timeout=COLLECTIVE_TIMEOUT,
            # Binding NCCL to the device up front avoids a guess (and a warning) at the first
            # barrier; gloo takes no device.
            device_id=torch_device if device == "cuda" else None,
        )
    _info = DistInfo(rank, local_rank, world_size, torch_device)
    return _info


def info() -> DistInfo:
    """The current process's place in the world (a world of one before :func:`setup`)."""
    return _info or DistInfo(0, 0, 1, torch.device("cpu"))


def is_primary() -> bool:
    """True on the one process (global rank 0) that does every side effect."""
    return info().is_primary


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if _active():
        if info().device.type == "cuda":
            dist.barrier(device_ids=[info().local_rank])
        else:
            dist.barrier()


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    """Element-wise sums over all processes (float64, so counts of images stay exact)."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=info().device)
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def all_reduce_max(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=info().device)
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def cleanup() -> None:
    """Leave the process group (a no-op without one); call once at exit."""
    global _info
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _info = None
