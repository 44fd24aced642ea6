"""Where a training run stands after each epoch, and what it decides from it.

The best epoch, early stopping and a tuning trial's pruning are decided from all-reduced
metrics, identical on every rank, so every rank takes the same decision and nobody waits alone
at the next collective. The progress is plain values, saved in every checkpoint; a resumed run
picks it up where the checkpoint left it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from models.atomic import atomic_file
from tasks.train import distributed
from tasks.train.checkpoint import load_checkpoint
from tasks.train.loop import METRICS, TOP1, TOP5, VAL_LOSS, StepParts, TrainStats
from tasks.train.params import RunConfig
from tasks.train.run_folder import BEST_WEIGHTS, CHECKPOINT

if TYPE_CHECKING:
    from tasks.tune.pruning import TrialReporter

log = logging.getLogger("imageops.train")


@dataclass
class Progress:
    """Where training stands after ``epoch`` completed epochs; plain values, checkpointed."""

    epoch: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    best_top1: float = -1.0
    best_epoch: int = 0
    best_val_loss: float = math.inf
    bad_epochs: int = 0
    stopped_early: bool = False
    pruned: bool = False  # a tuning trial stopped for being worse than the median (tasks.tune)

    def record(self, epoch: int, metrics: dict[str, float], patience: int, epochs: int) -> bool:
        """Add ``epoch``'s metrics; update the best epoch and early stopping.

        Returns whether validation top-1 improved (the epoch is the new best).
        """
        self.history.append({"epoch": float(epoch), **metrics})
        self.epoch = epoch
        improved = metrics[TOP1] > self.best_top1
        if improved:
            self.best_top1, self.best_epoch = metrics[TOP1], epoch
        if metrics[VAL_LOSS] < self.best_val_loss:
            self.best_val_loss, self.bad_epochs = metrics[VAL_LOSS], 0
        else:
            self.bad_epochs += 1
        self.stopped_early = self.bad_epochs >= patience and epoch < epochs
        return improved


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights copied to the CPU, contiguous (what safetensors and checkpoints take)."""
    return {k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}


def save_best(run_dir: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0: keep the weights of the best epoch in the run folder, atomically; returns them."""
    best_state = cpu_state(model)
    with atomic_file(run_dir / BEST_WEIGHTS) as tmp:
        save_file(best_state, str(tmp))
    return best_state


def resume(
    config: RunConfig, model: nn.Module, parts: StepParts, primary: bool
) -> tuple[Progress, dict[str, torch.Tensor] | None, bool]:
    """Load the run's checkpoint, if it has one of this configuration and data, into the model
    and ``parts``: (progress, rank 0's best weights so far, whether it resumed)."""
    checkpoint = load_checkpoint(config.run_dir / CHECKPOINT, config.digest())
    if checkpoint is None:
        return Progress(), None, False
    model.load_state_dict(checkpoint["model"])
    parts.optimizer.load_state_dict(checkpoint["optimizer"])
    parts.scheduler.load_state_dict(checkpoint["scheduler"])
    parts.scaler.load_state_dict(checkpoint["scaler"])
    if parts.ema is not None:
        parts.ema.load_state_dict(checkpoint["ema"])
    progress = Progress(**checkpoint["progress"])
    best_state = load_file(str(config.run_dir / BEST_WEIGHTS)) if primary else None
    return progress, best_state, True


def checkpoint_state(
    config: RunConfig, model: nn.Module, parts: StepParts, progress: Progress
) -> dict[str, Any]:
    """Everything a resumed run needs after ``progress.epoch``, for :func:`save_checkpoint`."""
    return {
        "config_digest": config.digest(),
        "config": config.model_dump(mode="json"),
        "mlflow_run_id": config.mlflow_run_id,
        "data_version": dict(config.data_version),
        "epoch": progress.epoch,
        "model": cpu_state(model),
        "optimizer": parts.optimizer.state_dict(),
        "scheduler": parts.scheduler.state_dict(),
        "scaler": parts.scaler.state_dict(),
        "progress": asdict(progress),
        **({} if parts.ema is None else {"ema": cpu_state(parts.ema)}),
    }


def prune_vote(reporter: TrialReporter | None, metrics: dict[str, float], epoch: int) -> bool:
    """Rank 0 reports the epoch to the study and asks whether to prune; every rank gets the answer.

    Only rank 0 talks to the study (``reporter`` is None elsewhere); the all-reduce of its vote
    is a collective every rank joins, so all ranks stop together and none waits alone.
    """
    vote = reporter.report(metrics, epoch) if reporter is not None else False
    (votes,) = distributed.all_reduce_sum([1.0 if vote else 0.0])
    return votes > 0


def summary(progress: Progress) -> dict[str, Any]:
    """The run's result: the metrics of its best epoch and its last, and how it ended."""
    best = next(h for h in progress.history if int(h["epoch"]) == progress.best_epoch)
    final = progress.history[-1]
    metrics = {name: best[name] for name in METRICS}
    metrics |= {f"final/{name}": final[name] for name in METRICS}
    return {
        "metrics": metrics,
        "best_epoch": progress.best_epoch,
        "history": progress.history,
        "epochs_trained": progress.epoch,
        "stopped_early": progress.stopped_early,
        "pruned": progress.pruned,
    }


def log_epoch(config: RunConfig, progress: Progress, stats: TrainStats, val: dict) -> None:
    """One line per epoch, and why training stops early when it does."""
    params = config.params
    log.info(
        "epoch %d/%d: train loss %.4f, val loss %.4f, top-1 %.4f, top-%d %.4f, %.1f img/s "
        "(%.1f per process) (best top-1 %.4f at epoch %d)",
        progress.epoch,
        params.epochs,
        stats.loss,
        val[VAL_LOSS],
        val[TOP1],
        min(5, len(config.classes)),
        val[TOP5],
        stats.images_per_sec,
        stats.images_per_sec_per_process,
        progress.best_top1,
        progress.best_epoch,
    )
    if progress.stopped_early:
        log.info(
            "early stop: no lower validation loss for %d epochs (patience %d)",
            progress.bad_epochs,
            params.patience,
        )
    if progress.pruned:
        log.info(
            "pruned: %s of this tuning trial is worse than the median of the completed "
            "trials at epoch %d",
            config.tuning.metric if config.tuning else "the metric",
            progress.epoch,
        )
