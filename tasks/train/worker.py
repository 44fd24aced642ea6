"""The torchrun entry: ``python -m tasks.train.worker --config <run folder>/config.json``.

Every rank trains; rank 0 alone logs to MLflow and writes checkpoints and the ModelDirectory.
Each rank logs to ``rank_<rank>.log``; a restarted worker resumes from the last epoch's checkpoint
of the same configuration and data. Details: docs/training.md#the-worker.
"""

from __future__ import annotations

if __name__ == "__main__":
    # Before the imports below, which take seconds (tens on a loaded machine): a torchrun killed
    # meanwhile takes this worker with it now, not once torch is imported.
    from tasks.shared.parent_death import die_with_torchrun

    die_with_torchrun()  # torchrun, SIGKILLed with its launcher, cannot stop its workers itself
    import sys

    from tasks.shared.fork_server import start_for_worker

    start_for_worker(sys.argv[1:])  # its import of torch runs beside this process's own

import argparse
import logging
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

from models.zoo import head_parameters
from tasks.data.transform import input_size
from tasks.shared import faults
from tasks.shared.errors import TrainingFailedError
from tasks.shared.settings import RedactingFormatter
from tasks.train import distributed
from tasks.train.build import (
    batch_mixer,
    build_loaders,
    build_optimizer,
    configure_backends,
    load_datasets,
    loader_setup,
    prepare_model,
    training_loss,
    weight_average,
)
from tasks.train.checkpoint import save_checkpoint
from tasks.train.failure import read_failures, record_failure
from tasks.train.finish import write_model
from tasks.train.loop import (
    StepParts,
    check_weights,
    derive_seed,
    epoch_metrics,
    evaluate,
    seed_everything,
    train_one_epoch,
)
from tasks.train.params import RunConfig
from tasks.train.precision import Amp, precision_reason
from tasks.train.progress import checkpoint_state, log_epoch, prune_vote, resume, save_best, summary
from tasks.train.run_folder import BEST_WEIGHTS, CHECKPOINT, rank_log
from tasks.train.schedule import build_scheduler

if TYPE_CHECKING:
    from tasks.train.tracker import Tracker

# The entry; the worker's parts are in build, progress and finish, its files in run_folder.
__all__ = ["main", "train_worker"]

log = logging.getLogger("imageops.train")


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


def _check_world(config: RunConfig, dist: distributed.DistInfo) -> None:
    """Refuse a world that is not the one the run was configured for; log where this rank is."""
    if dist.world_size != config.world_size:
        raise TrainingFailedError(
            f"This worker runs in a world of {dist.world_size} processes; the run was configured "
            f"for {config.world_size}.",
            "Start training with `imageops train` (or the train flow), which sets up torchrun "
            "to match.",
        )
    device = dist.device
    lent = os.environ.get("CUDA_VISIBLE_DEVICES") if device.type == "cuda" else None
    # Where the ranks meet, and on which interface: across machines, never a loopback address.
    meets = ""
    if dist.world_size > 1:
        meets = f", meeting at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        ifname = os.environ.get(
            "NCCL_SOCKET_IFNAME" if device.type == "cuda" else "GLOO_SOCKET_IFNAME"
        )
        meets += f" via {ifname}" if ifname else ""
    log.info(
        "attempt %d: rank %d of %d on %s%s, %d compute threads, on host %s%s, run folder %s",
        _attempt(),
        dist.rank,
        dist.world_size,
        device,
        f" (CUDA_VISIBLE_DEVICES={lent})" if lent else "",  # a tuning trial's GPUs
        torch.get_num_threads(),  # more than the CPUs reserved per process spin idle
        socket.gethostname(),
        meets,
        config.run_dir,
    )


def _train(config: RunConfig, dist: distributed.DistInfo) -> dict[str, Any]:
    params = config.params
    device = dist.device
    _check_world(config, dist)
    datasets = load_datasets(config)
    num_classes = len(config.classes)
    setup = loader_setup(config, device)
    train_loader, sampler, val_loader = build_loaders(datasets, config, dist, setup)

    configure_backends(device)
    size = input_size(config.transform)
    amp = Amp.for_run(device.type, config.precision, size)
    model = prepare_model(config.architecture, num_classes, device, params.seed, amp, size)
    lr = params.learning_rate * dist.world_size  # Azure's rule: global batch = batch x world
    optimizer = build_optimizer(model, lr, params, head_parameters(config.architecture, model))
    scheduler = build_scheduler(
        optimizer,
        steps_per_epoch=-(-len(train_loader) // params.accumulation_steps),  # optimizer steps
        epochs=params.epochs,
        warmup_epochs=params.warmup_epochs,
        schedule=params.schedule,
        head_only_epochs=params.head_only_epochs,
    )
    criterion = training_loss(params, datasets["train"].targets, num_classes).to(device)
    parts = StepParts(
        optimizer,
        scheduler,
        criterion,
        amp.grad_scaler(),
        amp,
        device,
        mix=batch_mixer(params, num_classes),
        clip_grad_norm=params.clip_grad_norm,
        accumulation=params.accumulation_steps,
        ema=weight_average(model, params.ema_decay),
    )
    if parts.ema is not None:  # a step skipped (fp16 overflow) is not averaged either
        ema = parts.ema
        optimizer.register_step_post_hook(lambda *_: ema.update_parameters(model))
    progress, best_state, resumed = resume(config, model, parts, dist.is_primary)
    if resumed:
        log.info("resumed from the checkpoint after epoch %d", progress.epoch)
    # The loader processes make the first batches while the MLflow run opens: the first epoch
    # does not wait for them (docs/training.md#the-worker).
    train_loader.prepare(progress.epoch + 1)
    val_loader.prepare()
    net: nn.Module = model
    if dist.world_size > 1:
        net = DistributedDataParallel(
            model, device_ids=[dist.local_rank] if device.type == "cuda" else None
        )
    if params.compile:  # the DDP wrapper compiled: its graph breaks at bucket edges (DDPOptimizer)
        net = torch.compile(net)
    tracker: Tracker | None = None
    if dist.is_primary:
        from tasks.train.tracker import Tracker  # mlflow on rank 0 only

        # A resumed run may lack the epochs trained before the crash: the first record backfills.
        tracker = Tracker(config.mlflow_run_id, behind=resumed)
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
        setup.num_workers,
    )
    # What was chosen and why, from what the hardware is (never a timing): docs/precision.md.
    why = precision_reason(params.precision, config.precision, device.type, size)
    log.info("precision %s: %s (%s)", params.precision, config.precision, why)
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
            parts,
            epoch=epoch,
            epochs=params.epochs,
            print_frequency=params.print_frequency,
            log=log,
        )
        check_weights(model, epoch, config.precision)
        validated = model if parts.ema is None else parts.ema.module  # type: ignore[union-attr]
        val = evaluate(
            validated,
            val_loader,
            device=device,
            num_classes=num_classes,
            memory_format=amp.memory_format,
        )
        metrics = epoch_metrics(stats, val)
        # The values compared here are all-reduced, hence identical on every rank: every rank
        # takes the same decision and nobody waits alone at the next collective.
        improved = progress.record(epoch, metrics, params.patience, params.epochs)
        if improved and dist.is_primary:
            best_state = save_best(config.run_dir, validated)
        if config.tuning is not None:
            progress.pruned = prune_vote(reporter, metrics, epoch) and epoch < params.epochs
        if dist.is_primary:
            save_checkpoint(
                config.run_dir / CHECKPOINT, checkpoint_state(config, model, parts, progress)
            )
            _store_checkpoint(config)
        distributed.barrier()
        faults.point("train.epoch_end", rank=dist.rank, epoch=epoch, attempt=_attempt())
        # After the checkpoint: a kill between the two leaves an epoch trained and saved but not
        # in MLflow, which the next record (or the launcher) backfills from the history.
        if tracker is not None:
            tracker.record(progress.history)
        log_epoch(config, progress, stats, val)

    result = summary(progress)
    if dist.is_primary:
        write_model(config, model, best_state, progress, result)
    distributed.barrier()  # nobody leaves (and tears the group down) before rank 0 is done
    return result


def _store_checkpoint(config: RunConfig) -> None:
    """Best weights, then the checkpoint, to the checkpoint store (when one is set).

    In this order: a crash between the two resumes one epoch early with the newer best weights,
    never with best weights older than the checkpoint's record of them.
    """
    from tasks.shared.settings import get_settings
    from tasks.train.checkpoint_store import upload_checkpoint

    settings = get_settings()
    run_id = str(config.mlflow_run_id)
    if settings.checkpoint_url is None:
        return
    if (config.run_dir / BEST_WEIGHTS).is_file():
        upload_checkpoint(config.run_dir / BEST_WEIGHTS, run_id, settings)
    upload_checkpoint(config.run_dir / CHECKPOINT, run_id, settings)


@record
def main(argv: list[str] | None = None) -> None:
    """Parse ``--config`` and train; ``@record`` hands torchrun the traceback of a failure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="the run's config.json")
    args = parser.parse_args(argv)
    train_worker(RunConfig.load(args.config))


if __name__ == "__main__":
    main()
    # Trained, written and flushed: leave without the interpreter's teardown of torch (1.5 s of
    # CPU per process here, at the end of every training). Loader processes go with this one
    # (tasks.shared.parent_death), as they would with a killed rank.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
