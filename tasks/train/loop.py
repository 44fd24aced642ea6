"""One training epoch and one evaluation pass, with metrics reduced over all processes.

Every metric is all-reduced across ranks, so every decision taken from one (NaN stop, early stop,
best model) is the same on every rank and no peer is left waiting. Model and batches are in the
run's memory format, under autocast in its precision. Details: docs/training.md#the-loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from tasks.shared.errors import TrainingDivergedError
from tasks.train import distributed
from tasks.train.precision import Amp

LOSS = "train/loss"
VAL_LOSS = "val/loss"
TOP1 = "val/top1"
TOP5 = "val/top5"
THROUGHPUT = "train/images_per_sec"
# Per process, i.e. per GPU on GPU: what to compare across machines and world sizes.
THROUGHPUT_PER_PROCESS = "train/images_per_sec_per_process"
LR = "train/lr"
# What a run reports after every epoch: logged to MLflow per epoch, kept in the run's history,
# and what a tuning study may optimise (tasks.tune.spec). :func:`epoch_metrics` reports exactly
# these: a metric added here is reported and tunable.
EPOCH_METRICS = (LOSS, VAL_LOSS, TOP1, TOP5, THROUGHPUT, THROUGHPUT_PER_PROCESS, LR)
# A run's summary: these at its best epoch and at its last.
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
    # The job's images/s divided by the number of processes (one per GPU on GPU).
    images_per_sec_per_process: float
    # This process's wait for its first batch (loader processes starting, or a cold cache).
    first_batch_seconds: float = 0.0


def epoch_metrics(stats: TrainStats, val: Mapping[str, float]) -> dict[str, float]:
    """One epoch's report, every name of :data:`EPOCH_METRICS` (``val``: :func:`evaluate`'s)."""
    measured = {
        LOSS: stats.loss,
        **val,
        THROUGHPUT: stats.images_per_sec,
        THROUGHPUT_PER_PROCESS: stats.images_per_sec_per_process,
        LR: stats.lr,
    }
    return {name: measured[name] for name in EPOCH_METRICS}


def to_device(
    images: torch.Tensor, device: torch.device, memory_format: torch.memory_format
) -> torch.Tensor:
    """A batch on ``device`` in ``memory_format`` (asynchronous from pinned memory)."""
    return images.to(device, non_blocking=True, memory_format=memory_format)


def model_input(
    loader: DataLoader,
    images: torch.Tensor,
    device: torch.device,
    memory_format: torch.memory_format,
) -> torch.Tensor:
    """A batch of ``loader`` as the model takes it: on ``device``, in ``memory_format``, finished
    there by the loader's ``finish_on_device`` steps when it has them (uint8 batches made float and
    normalised on the GPU: :func:`tasks.train.data.make_loader`)."""
    images = to_device(images, device, memory_format)
    finish = getattr(loader, "finish_on_device", None)
    return finish(images) if finish is not None else images


def _check_finite(loss: float, epoch: int, step: int, lr: float) -> None:
    if not math.isfinite(loss):
        raise TrainingDivergedError(
            f"The training loss became {loss} in epoch {epoch} (iteration {step}) at learning "
            f"rate {lr:.3g}: training diverged.",
            "Lower learning_rate (distributed runs use it x the number of processes) or raise "
            "warmup_epochs.",
        )


@dataclass(frozen=True)
class StepParts:
    """What every optimisation step uses besides the model and the batch: built once per run."""

    optimizer: Optimizer
    scheduler: LRScheduler  # stepped per batch
    criterion: nn.Module
    scaler: torch.amp.GradScaler  # from ``amp.grad_scaler()``
    amp: Amp
    device: torch.device
    # MixUp / CutMix of a batch on the device: (images, labels) -> (images, soft labels).
    mix: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    clip_grad_norm: float = 0.0  # 0: no clipping
    accumulation: int = 1  # batches whose gradients make one optimizer step
    # The EMA of the weights (torch.optim.swa_utils.AveragedModel), updated after every optimizer
    # step; validated, kept as the best and exported instead of the weights when set.
    ema: nn.Module | None = None


def train_one_epoch(
    model: nn.Module,
    loader: DataLoader,
    parts: StepParts,
    *,
    epoch: int,
    epochs: int,
    print_frequency: int,
    log: logging.Logger,
) -> TrainStats:
    """Train one epoch; the scheduler steps per optimizer step (a batch, or ``accumulation`` of
    them). Raises TrainingDivergedError on NaN/inf.

    Images/s counts from the first batch requested, so unhidden loading counts against it. The loss
    is read back only every ``print_frequency`` steps, so the CPU never waits for a step and the GPU
    never idles. Details: docs/training.md#train_one_epoch.
    """
    optimizer, scheduler, criterion = parts.optimizer, parts.scheduler, parts.criterion
    scaler, amp, device = parts.scaler, parts.amp, parts.device
    model.train()
    # float64 sums of float32 losses: the same arithmetic as summing their Python floats.
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    steps = len(loader)
    first_batch = 0.0
    start = time.perf_counter()
    for step, (images, targets) in enumerate(loader, start=1):
        if step == 1:
            first_batch = time.perf_counter() - start
            log.info("epoch %d/%d: first batch after %.2f s", epoch, epochs, first_batch)
        images = model_input(loader, images, device, amp.memory_format)
        targets = targets.to(device, non_blocking=True)
        if parts.mix is not None:  # targets become class probabilities (the loss takes both)
            images, targets = parts.mix(images, targets)
        # Gradients add up over ``accumulation`` batches, then one optimizer step (and the last,
        # shorter window of the epoch); DDP reduces them only on the window's last batch.
        window_start = (step - 1) % parts.accumulation == 0
        stepping = step % parts.accumulation == 0 or step == steps
        window = min(
            parts.accumulation, steps - (step - 1) // parts.accumulation * parts.accumulation
        )
        if window_start:
            optimizer.zero_grad(set_to_none=True)
        quiet = not stepping and hasattr(model, "no_sync")
        with model.no_sync() if quiet else contextlib.nullcontext():  # type: ignore[operator]
            with amp.autocast():
                logits = model(images)
            # Softmax and log of a low-precision logit lose digits the loss needs: float32.
            loss = criterion(logits.float(), targets)
            scaler.scale(loss / window).backward()
        if stepping:
            if parts.clip_grad_norm > 0:
                scaler.unscale_(optimizer)  # clip the true gradients, not the loss-scaled ones
                nn.utils.clip_grad_norm_(model.parameters(), parts.clip_grad_norm)
            scaler.step(optimizer)  # skipped (and the scale lowered) if fp16 gradients overflowed
            scaler.update()
            scheduler.step()
        loss_sum += loss.detach().double() * targets.size(0)
        count += targets.size(0)
        # Every rank runs the same number of steps (DistributedSampler pads the shards), so all
        # reach this collective together; the NaN check on the reduced value stops all at once.
        if step % print_frequency == 0 or step == steps:
            total, n = distributed.all_reduce_sum([float(loss_sum), count])
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
    total, n = distributed.all_reduce_sum([float(loss_sum), count])
    # Throughput of the whole job: every rank's images over the slowest rank's time.
    slowest = distributed.all_reduce_max(elapsed)
    throughput = n / max(slowest, 1e-9)
    return TrainStats(
        loss=total / n,
        images=int(n),
        images_per_sec=throughput,
        lr=optimizer.param_groups[0]["lr"],
        images_per_sec_per_process=throughput / distributed.info().world_size,
        first_batch_seconds=first_batch,
    )


@torch.no_grad()
def check_weights(model: nn.Module, epoch: int, precision: str) -> None:
    """Raise TrainingDivergedError when a weight or BatchNorm statistic is NaN or infinite.

    A non-finite weight need not show in the training loss (oneDNN's convolution skips the kernel
    taps that fall on padding) yet poisons every prediction of the exported model, which
    multiplies them by the padding's zeros. Checked once per epoch, before the checkpoint: the
    decision is all-reduced, so every rank raises together.
    """
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    bad = [n for n, t in tensors.items() if t.is_floating_point() and not t.isfinite().all()]
    (count,) = distributed.all_reduce_sum([len(bad)])
    if count:
        raise TrainingDivergedError(
            f"Weights became NaN or infinite in epoch {epoch} (precision {precision}): "
            f"{', '.join(bad[:5]) or 'on another rank'}{' ...' if len(bad) > 5 else ''}.",
            "Lower learning_rate or raise warmup_epochs; if it persists with precision bf16 or "
            "fp16, train with precision='fp32'.",
        )


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    *,
    device: torch.device,
    num_classes: int,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> dict[str, float]:
    """Validation loss, top-1 and top-k (k = min(5, classes)) over every rank's shard.

    Pass the unwrapped module: a DDP forward may sync buffers, a collective that would hang on
    the uneven validation shards. Always float32, whatever the training precision: the metrics
    (and the choice of the best epoch) are then those of the model as it is exported and scored.
    ``memory_format``: the model's (batches are converted to it).
    """
    model.eval()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    k = min(5, num_classes)
    # Summed on the device and read once at the end: no wait for the GPU after every batch.
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    top1 = torch.zeros((), dtype=torch.int64, device=device)
    topk = torch.zeros((), dtype=torch.int64, device=device)
    count = 0
    for images, targets in loader:
        images = model_input(loader, images, device, memory_format)
        targets = targets.to(device, non_blocking=True)
        logits = model(images)
        loss_sum += criterion(logits, targets).double()
        ranked = logits.topk(k, dim=1).indices
        hits = ranked.eq(targets.unsqueeze(1))
        top1 += hits[:, 0].sum()
        topk += hits.any(dim=1).sum()
        count += targets.size(0)
    loss_sum, top1, topk, count = distributed.all_reduce_sum(
        [float(loss_sum), int(top1), int(topk), count]
    )
    return {VAL_LOSS: loss_sum / count, TOP1: top1 / count, TOP5: topk / count}
