"""One training epoch and one evaluation pass, with metrics reduced over all processes.

Every metric is a sum and a count all-reduced across ranks, so ``train/loss`` is the mean over all
samples of all ranks, not rank 0's view. Every decision taken from a metric (NaN stop, early stop,
best model) is taken from these reduced values, which are identical on every rank, so ranks
never disagree and leave a peer waiting in a collective.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from tasks.errors import TrainingDivergedError
from tasks.train import distributed

LOSS = "train/loss"
VAL_LOSS = "val/loss"
TOP1 = "val/top1"
TOP5 = "val/top5"
THROUGHPUT = "train/images_per_sec"
LR = "train/lr"
METRICS = (LOSS, VAL_LOSS, TOP1, TOP5, THROUGHPUT)


def derive_seed(*parts: object) -> int:
    """A 62-bit seed from ``parts`` (e.g. the user's seed, "augment", rank, epoch).

    Hashing lets the user's seed be any integer (negative or huge) and gives unrelated streams
    for unrelated purposes; 62 bits leave room for DistributedSampler's ``seed + epoch``.
    """
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 2


def seed_everything(seed: int) -> None:
    """Seed torch, numpy and random (the transforms use torch; numpy and random for safety)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


@dataclass(frozen=True)
class TrainStats:
    loss: float
    images: int
    images_per_sec: float
    lr: float


def _check_finite(loss: float, epoch: int, step: int, lr: float) -> None:
    if not math.isfinite(loss):
        raise TrainingDivergedError(
            f"The training loss became {loss} in epoch {epoch} (iteration {step}) at learning "
            f"rate {lr:.3g}: training diverged.",
            "Lower learning_rate (distributed runs use it x the number of processes) or raise "
            "warmup_epochs.",
        )


def train_one_epoch(
    model: nn.Module,
    loader: DataLoader,
    *,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    criterion: nn.Module,
    device: torch.device,
    epoch: int,
    epochs: int,
    print_frequency: int,
    log: logging.Logger,
) -> TrainStats:
    """Train one epoch; the scheduler steps per batch. Raises TrainingDivergedError on NaN/inf."""
    model.train()
    loss_sum, count = 0.0, 0
    steps = len(loader)
    start = time.perf_counter()
    for step, (images, targets) in enumerate(loader, start=1):
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        loss_sum += loss.item() * targets.size(0)
        count += targets.size(0)
        # Every rank runs the same number of steps (DistributedSampler pads the shards), so all
        # reach this collective together; the NaN check on the reduced value stops all at once.
        if step % print_frequency == 0 or step == steps:
            total, n = distributed.all_reduce_sum([loss_sum, count])
            lr = optimizer.param_groups[0]["lr"]
            _check_finite(total / n, epoch, step, lr)
            elapsed = time.perf_counter() - start
            log.info(
                "epoch %d/%d [%d/%d] loss %.4f (mean over all ranks %.4f) lr %.5f %.1f img/s",
                epoch,
                epochs,
                step,
                steps,
                loss.item(),
                total / n,
                lr,
                count / max(elapsed, 1e-9),
            )
    elapsed = time.perf_counter() - start
    total, n = distributed.all_reduce_sum([loss_sum, count])
    # Throughput of the whole job: every rank's images over the slowest rank's time.
    slowest = distributed.all_reduce_max(elapsed)
    return TrainStats(
        loss=total / n,
        images=int(n),
        images_per_sec=n / max(slowest, 1e-9),
        lr=optimizer.param_groups[0]["lr"],
    )


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: DataLoader, *, device: torch.device, num_classes: int
) -> dict[str, float]:
    """Validation loss, top-1 and top-k (k = min(5, classes)) over every rank's shard.

    Pass the unwrapped module: a DDP forward may sync buffers, a collective that would hang on
    the uneven validation shards.
    """
    model.eval()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    k = min(5, num_classes)
    loss_sum, top1, topk, count = 0.0, 0, 0, 0
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        logits = model(images)
        loss_sum += criterion(logits, targets).item()
        ranked = logits.topk(k, dim=1).indices
        hits = ranked.eq(targets.unsqueeze(1))
        top1 += int(hits[:, 0].sum())
        topk += int(hits.any(dim=1).sum())
        count += targets.size(0)
    loss_sum, top1, topk, count = distributed.all_reduce_sum([loss_sum, top1, topk, count])
    return {VAL_LOSS: loss_sum / count, TOP1: top1 / count, TOP5: topk / count}
