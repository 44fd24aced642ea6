"""The torchrun entry: ``python -m tasks.train.worker --config <run folder>/config.json``.

The same entry runs under torchrun (one process per rank) or as a plain process (a world of one).
Every rank trains; rank 0 alone does the side effects: MLflow metrics (which an MLflow outage
delays but never stops the training over: :mod:`tasks.train.tracker`), checkpoints, the best
weights and the final ModelDirectory. Each rank logs to ``rank_<rank>.log`` in the run folder
(rank 0, the master, also to the console).

A checkpoint is written after every epoch; when torchrun restarts the workers (``--max-restarts``),
or a launcher is pointed at the same run, the worker resumes from it if it belongs to the same
configuration and data.

Speed (see docs/benchmarks.md): channels-last model and batches (NCHW for small inputs on CPU),
autocast in the run's resolved precision (bf16 on a CPU that has it, for inputs of 64 px and more;
bf16 or fp16 with a gradient scaler on GPU), a DataLoader
with persistent loader processes forked from a fork server where they pay (GPU), uint8 batches in
pinned memory normalised on the GPU (:mod:`tasks.train.data`).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

from models.atomic import atomic_file, write_json
from models.directory import ModelInfo, save_model_directory
from models.untrained import ModelSpec
from models.zoo import build_model
from tasks import faults
from tasks.errors import InvalidDatasetError, TrainingFailedError
from tasks.imagedir import read_manifest
from tasks.parent_death import die_with_torchrun
from tasks.settings import RedactingFormatter
from tasks.train import distributed
from tasks.train.checkpoint import CHECKPOINT, load_checkpoint, save_checkpoint
from tasks.train.curves import plot_curves
from tasks.train.data import (
    ManifestImageFolder,
    ShardSampler,
    loader_workers,
    make_loader,
    training_loader,
)
from tasks.train.failure import read_failures, record_failure
from tasks.train.loop import (
    METRICS,
    TOP1,
    TOP5,
    VAL_LOSS,
    check_weights,
    derive_seed,
    epoch_metrics,
    evaluate,
    seed_everything,
    train_one_epoch,
)
from tasks.train.params import RunConfig, manifest_fingerprint
from tasks.train.precision import Amp
from tasks.train.schedule import build_scheduler
from tasks.transform import input_size, transform_for

if TYPE_CHECKING:
    from tasks.train.tracker import Tracker
    from tasks.tune.pruning import TrialReporter

RESULT = "result.json"
BEST_WEIGHTS = "best.safetensors"
CURVES = "training_curves.png"
# Azure's optimizer: SGD with (Nesterov) momentum; weight decay as in torchvision's recipes.
# The defaults of TrainParams.momentum / weight_decay (tunable per run).
MOMENTUM = 0.9
WEIGHT_DECAY = 1e-4

log = logging.getLogger("imageops.train")


def rank_log(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"rank_{rank}.log"


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _setup_logging(run_dir: Path, rank: int) -> None:
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    log.setLevel(logging.INFO)
    log.propagate = False
    formatter = RedactingFormatter(f"%(asctime)s rank {rank} %(levelname)s %(message)s")
    run_dir.mkdir(parents=True, exist_ok=True)
    # Append: a restarted attempt adds to the same file, so the history of the run stays whole.
    handlers: list[logging.Handler] = [
        logging.FileHandler(rank_log(run_dir, rank), mode="a", encoding="utf-8")
    ]
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    for handler in handlers:
        handler.setFormatter(formatter)
        log.addHandler(handler)


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


def _cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}


def configure_backends(device: torch.device) -> None:
    """Backend switches for speed on ``device``.

    On CUDA, cuDNN's autotuner (``cudnn.benchmark``) stays off: measured on an H100 for resnet50
    in bf16 channels-last (docs/benchmarks.md, "GPU (H100)"), its search cost 14.5 s in the first
    three steps and 7.9 s more for the last, smaller batch of an epoch, and the algorithms it
    found were no faster than cuDNN's own choice (3,715 against 3,746 images/s). GPU runs repeat
    a seed up to float rounding (some kernels add in a varying order); CPU runs bit for bit.
    """
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False


def prepare_model(
    spec: ModelSpec, num_classes: int, device: torch.device, seed: int, amp: Amp
) -> nn.Module:
    """The network for ``spec``, initialised from ``seed``, on ``device`` in ``amp``'s layout.

    Every rank passes the same seed: identical initial weights everywhere (DDP would broadcast
    rank 0's anyway, but a 1-process run must match too).
    """
    seed_everything(derive_seed(seed, "init"))
    return build_model(spec, num_classes).to(device, memory_format=amp.memory_format)


def build_optimizer(
    model: nn.Module,
    lr: float,
    momentum: float = MOMENTUM,
    weight_decay: float = WEIGHT_DECAY,
) -> torch.optim.Optimizer:
    """The Azure design's optimizer: SGD with Nesterov momentum (0.9) and weight decay (1e-4).

    Nesterov needs a momentum above 0: a momentum of 0 (a tuning trial may ask for it) is plain
    SGD.

    Fused: one kernel updates every parameter, where the default (foreach) makes a pass over all
    weights per term (decay, momentum, Nesterov); on CPU that saves about 5 ms a step for resnet18,
    which counts at small image sizes (docs/benchmarks.md).
    """
    return torch.optim.SGD(
        model.parameters(),
        lr=lr,
        momentum=momentum,
        nesterov=momentum > 0,
        weight_decay=weight_decay,
        fused=True,
    )


def _refuse_repeated_user_error(run_dir: Path) -> None:
    """After a restart, fail at once if the previous attempt failed on a user error.

    torchrun restarts on any failure, but a wrong input fails the same way every time; only
    crashes (a killed process, a lost peer) are worth another attempt.
    """
    if _attempt() == 0:
        return
    for failure in read_failures(run_dir):
        error = failure.as_error()
        if error is not None and failure.attempt < _attempt():
            raise error


def train_worker(config: RunConfig) -> dict[str, Any]:
    """Train as this process's rank; returns the result that rank 0 writes to ``result.json``."""
    rank = int(os.environ.get("RANK", "0"))
    _setup_logging(config.run_dir, rank)
    try:
        _refuse_repeated_user_error(config.run_dir)
        dist = distributed.setup(config.device)
        return _train(config, dist)
    except Exception as exc:
        log.exception("training failed on rank %d: %s", rank, exc)
        record_failure(config.run_dir, rank, _attempt(), exc)
        raise
    finally:
        distributed.cleanup()
        for handler in log.handlers:
            handler.flush()


def _train(config: RunConfig, dist: distributed.DistInfo) -> dict[str, Any]:
    params = config.params
    device = dist.device
    if dist.world_size != config.world_size:
        raise TrainingFailedError(
            f"This worker runs in a world of {dist.world_size} processes; the run was configured "
            f"for {config.world_size}.",
            "Start training with `imageops train` (or the train flow), which sets up torchrun "
            "to match.",
        )
    lent = os.environ.get("CUDA_VISIBLE_DEVICES") if device.type == "cuda" else None
    log.info(
        "attempt %d: rank %d of %d on %s%s, run folder %s",
        _attempt(),
        dist.rank,
        dist.world_size,
        device,
        f" (CUDA_VISIBLE_DEVICES={lent})" if lent else "",  # a tuning trial's GPUs
        config.run_dir,
    )

    # Data: the manifests must be the ones the launcher checked (a resumed run sees the same data).
    datasets = {}
    for role, root in (("train", config.train_data), ("val", config.val_data)):
        if manifest_fingerprint(root) != config.data_fingerprint[role]:
            raise InvalidDatasetError(
                f"The {role} dataset {root} changed after this run was configured.",
                "Start a new run on the data as it is now.",
            )
        manifest = read_manifest(root)
        # Validation sees exactly what scoring will: the inference mode of the same spec.
        mode = "training" if role == "train" else "inference"
        transform = transform_for(config.transform, mode, root, manifest.transform)
        datasets[role] = ManifestImageFolder(root, manifest, transform)
    num_classes = len(config.classes)

    workers = loader_workers(device, params.num_workers)
    train_loader, sampler = training_loader(
        datasets["train"],
        batch_size=params.batch_size,
        seed=params.seed,
        rank=dist.rank,
        world_size=dist.world_size,
        device=device,
        num_workers=workers,
    )
    val_loader = make_loader(
        datasets["val"],
        batch_size=params.batch_size,
        sampler=ShardSampler(len(datasets["val"]), dist.rank, dist.world_size),
        device=device,
        num_workers=workers,
    )

    configure_backends(device)
    amp = Amp.for_run(device.type, config.precision, input_size(config.transform))
    model = prepare_model(config.architecture, num_classes, device, params.seed, amp)
    lr = params.learning_rate * dist.world_size  # Azure's rule: global batch = batch x world
    optimizer = build_optimizer(model, lr, params.momentum, params.weight_decay)
    scaler = amp.grad_scaler()
    scheduler = build_scheduler(
        optimizer,
        steps_per_epoch=len(train_loader),
        epochs=params.epochs,
        warmup_epochs=params.warmup_epochs,
    )
    progress = Progress()
    best_state: dict[str, torch.Tensor] | None = None
    checkpoint = load_checkpoint(config.run_dir / CHECKPOINT, config.digest())
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        scaler.load_state_dict(checkpoint["scaler"])
        progress = Progress(**checkpoint["progress"])
        if dist.is_primary:
            best_state = load_file(str(config.run_dir / BEST_WEIGHTS))
        log.info("resumed from the checkpoint after epoch %d", progress.epoch)
    net: nn.Module = model
    if dist.world_size > 1:
        net = DistributedDataParallel(
            model, device_ids=[dist.local_rank] if device.type == "cuda" else None
        )
    criterion = nn.CrossEntropyLoss()
    tracker: Tracker | None = None
    if dist.is_primary:
        from tasks.train.tracker import Tracker  # mlflow on rank 0 only

        # A resumed run may lack the epochs trained before the crash: the first record backfills.
        tracker = Tracker(config.mlflow_run_id, behind=checkpoint is not None)
        tracker.record(progress.history)
    reporter = None
    if config.tuning is not None and dist.is_primary:
        from tasks.tune.pruning import TrialReporter  # optuna only where a study listens

        reporter = TrialReporter(config.tuning)

    log.info(
        "training %s on %d images, validating on %d (%d classes); %d iterations per epoch and "
        "process; learning rate %g x %d processes = %g; precision %s (asked: %s), %s, "
        "%d loader process(es)",
        config.architecture.arch,
        len(datasets["train"]),
        len(datasets["val"]),
        num_classes,
        len(train_loader),
        params.learning_rate,
        dist.world_size,
        lr,
        config.precision,
        params.precision,
        "channels-last" if amp.channels_last else "NCHW",
        workers,
    )
    for epoch in range(progress.epoch + 1, params.epochs + 1):
        if progress.stopped_early or progress.pruned:
            break
        # Augmentation draws from a seed per image (tasks.train.data.SeededSampler); this
        # reseeds anything else random in this process per (seed, rank, epoch), so a resumed
        # run draws exactly what an uninterrupted one would have.
        seed_everything(derive_seed(params.seed, "epoch", dist.rank, epoch))
        sampler.set_epoch(epoch)
        stats = train_one_epoch(
            net,
            train_loader,
            optimizer=optimizer,
            scheduler=scheduler,
            criterion=criterion,
            device=device,
            amp=amp,
            scaler=scaler,
            epoch=epoch,
            epochs=params.epochs,
            print_frequency=params.print_frequency,
            log=log,
        )
        check_weights(model, epoch, config.precision)
        val = evaluate(
            model,
            val_loader,
            device=device,
            num_classes=num_classes,
            memory_format=amp.memory_format,
        )
        metrics = epoch_metrics(stats, val)
        progress.history.append({"epoch": float(epoch), **metrics})
        progress.epoch = epoch
        # The values compared here are all-reduced, hence identical on every rank: every rank
        # takes the same decision and nobody waits alone at the next collective.
        if val[TOP1] > progress.best_top1:
            progress.best_top1, progress.best_epoch = val[TOP1], epoch
            if dist.is_primary:
                best_state = _cpu_state(model)
                with atomic_file(config.run_dir / BEST_WEIGHTS) as tmp:
                    save_file(best_state, str(tmp))
        if val[VAL_LOSS] < progress.best_val_loss:
            progress.best_val_loss, progress.bad_epochs = val[VAL_LOSS], 0
        else:
            progress.bad_epochs += 1
        progress.stopped_early = progress.bad_epochs >= params.patience and epoch < params.epochs
        if config.tuning is not None:
            progress.pruned = _prune_vote(reporter, metrics, epoch) and epoch < params.epochs
        if dist.is_primary:
            save_checkpoint(
                config.run_dir / CHECKPOINT,
                {
                    "config_digest": config.digest(),
                    "config": config.model_dump(mode="json"),
                    "mlflow_run_id": config.mlflow_run_id,
                    "data_version": dict(config.data_version),
                    "epoch": epoch,
                    "model": _cpu_state(model),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "scaler": scaler.state_dict(),
                    "progress": asdict(progress),
                },
            )
        distributed.barrier()
        faults.point("train.epoch_end", rank=dist.rank, epoch=epoch, attempt=_attempt())
        # After the checkpoint: a kill between the two leaves an epoch trained and saved but not
        # in MLflow, which the next record (or the launcher) backfills from the history.
        if tracker is not None:
            tracker.record(progress.history)
        log.info(
            "epoch %d/%d: train loss %.4f, val loss %.4f, top-1 %.4f, top-%d %.4f, %.1f img/s "
            "(%.1f per process) (best top-1 %.4f at epoch %d)",
            epoch,
            params.epochs,
            stats.loss,
            val[VAL_LOSS],
            val[TOP1],
            min(5, num_classes),
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
                epoch,
            )

    result = _summary(progress)
    if dist.is_primary:
        _finish(config, model, best_state, progress, result)
    distributed.barrier()  # nobody leaves (and tears the group down) before rank 0 is done
    return result


def _prune_vote(reporter: TrialReporter | None, metrics: dict[str, float], epoch: int) -> bool:
    """Rank 0 reports the epoch to the study and asks whether to prune; every rank gets the answer.

    Only rank 0 talks to the study (``reporter`` is None elsewhere); the all-reduce of its vote
    is a collective every rank joins, so all ranks stop together and none waits alone.
    """
    vote = reporter.report(metrics, epoch) if reporter is not None else False
    (votes,) = distributed.all_reduce_sum([1.0 if vote else 0.0])
    return votes > 0


def _summary(progress: Progress) -> dict[str, Any]:
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


def _finish(
    config: RunConfig,
    model: nn.Module,
    best_state: dict[str, torch.Tensor] | None,
    progress: Progress,
    result: dict[str, Any],
) -> None:
    """Rank 0: the best weights become the ModelDirectory; the curves and the summary are written
    to the run folder, for the launcher to send to MLflow (it outlasts a tracking outage)."""
    if best_state is None:
        raise TrainingFailedError(
            f"No best weights in {config.run_dir} to write the model from.",
            "Start a new run; this run folder is incomplete.",
        )
    model.load_state_dict(best_state)
    params = config.params
    info = ModelInfo(
        architecture=config.architecture,
        classes=config.classes,
        transform=config.transform,
        train_params={
            **params.model_dump(mode="json"),
            "world_size": config.world_size,
            "device": config.device,
            "effective_learning_rate": params.learning_rate * config.world_size,
        },
        metrics={**result["metrics"], "epochs_trained": float(progress.epoch)},
        data_version=dict(config.data_version),
        mlflow_run_id=config.mlflow_run_id,
        best_epoch=progress.best_epoch,
    )
    save_model_directory(config.out, model, info)
    log.info("wrote the model of epoch %d to %s", progress.best_epoch, config.out)
    plot_curves(progress.history, config.run_dir / CURVES)
    write_json(config.run_dir / RESULT, result)


@record
def main(argv: list[str] | None = None) -> None:
    """Parse ``--config`` and train; ``@record`` hands torchrun the traceback of a failure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="the run's config.json")
    args = parser.parse_args(argv)
    train_worker(RunConfig.load(args.config))


if __name__ == "__main__":
    die_with_torchrun()  # torchrun, SIGKILLed with its launcher, cannot stop its workers itself
    main()
