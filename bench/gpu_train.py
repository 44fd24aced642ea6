"""GPU training speed: the model step alone, imageops's training epochs, the loader alone, and a
plain PyTorch loop, on one GPU (issue 19).

Usage: ``python -m bench.gpu_train [--full] [--json PATH] [--device cuda|cpu] [--quick]``

Without a CUDA GPU it prints why and exits (``python -m bench`` keeps its last results); ``--device
cpu --quick`` runs every part end to end on the CPU at toy sizes, to check the script, not to
measure. It needs torch, torchvision and the project's pure-Python dependencies only (pydantic,
pydantic-settings): no Prefect, MLflow or DVC.

It writes an ImageDirectory of synthetic JPEGs (about 10,000 for training and 1,000 for
validation, 180 to 320 px a side, 10 classes, written with PIL, with the project's manifest) and
then runs each part in a fresh interpreter, so no part inherits another's imports, fork server,
CUDA context or warm caches:

1. **step**: the model step alone on a synthetic batch already on the GPU (batch 128, 224 px), for
   resnet18 and resnet50: ``fp32 NCHW`` (the plain loop's step: float32, NCHW, SGD with momentum)
   and ``bf16 channels-last`` (imageops's step: :func:`tasks.train.build.prepare_model`,
   autocast, the fused SGD of :func:`~tasks.train.build.build_optimizer`). The bf16 resnet50
   figure is the ceiling the training epochs are held to.
2. **loader**: imageops's training loader alone (:func:`tasks.train.data.training_loader`, the
   ImageNet-style transform, the default loader count): the first batch's wait from the loader's
   creation in a fresh process (the fork server's start included), then images/s over the rest of
   the epoch and over a second one; the validation loader's first batch (the fork server already
   running). For reference, the first batch of the same loader with spawned (the old default, 4
   processes) and forked loader processes.
3. **imageops**: the torchrun worker's epoch loop as a world of one (:mod:`tasks.train.worker`'s
   set-up functions, :func:`tasks.train.loop.train_one_epoch`, :func:`~tasks.train.loop.evaluate`,
   :func:`~tasks.train.loop.check_weights` and a checkpoint per epoch); only MLflow's record and
   the final ModelDirectory are left out. images/s is the worker's own ``train/images_per_sec``.
4. **plain**: a pytorch/examples ImageNet-style loop on the same images: torchvision ImageFolder
   (RandomResizedCrop 224, flip, ToTensor, Normalize), a DataLoader with the same number of loader
   processes (the default start method, fork; pinned memory), the model in float32 NCHW, SGD with
   momentum, the loss read every step.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # `python bench/gpu_train.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import ROOT, Section, Stat, Table, no_cuda_here, run_main, usable_cores, versions

STARTED = time.perf_counter()  # this interpreter's start, near enough: a part's clock

CLASSES = 10
SEED = 1
LEARNING_RATE = 0.01
MOMENTUM = 0.9
WEIGHT_DECAY = 1e-4
# The engine's speed against plain torch's SGD step, not the recipe's: the Azure recipe (SGD,
# momentum, no augmentation policy) is the plain side's, and the recorded figures'.
RECIPE = "azure"
# The goals on one H100-class GPU.
GOAL_OF_CEILING = 0.90
GOAL_FIRST_EPOCH = 1.2
GOAL_VS_PLAIN = 1.8
# The Azure docs' figure (docs it imitates): ResNet50 on 8 V100s, about 1,670 images/s in all.
SEED_8_V100 = 1670.0


@dataclass(frozen=True)
class Plan:
    """What to run and how big."""

    device: str
    step_archs: tuple[str, ...]
    arch: str  # trained by the epoch loops
    batch: int
    crop: int  # the network's input size (RandomResizedCrop / CenterCrop)
    resize: int  # validation's resize before the center crop
    train_images: int
    val_images: int
    sides: tuple[int, int]  # image sides drawn from this range
    epochs: int
    step_warmup: int
    step_rounds: int
    step_steps: int
    workers: int | None  # None: what the worker picks (loader_workers)
    reference_workers: int  # the old default, for the spawn reference


GPU = Plan(
    device="cuda",
    step_archs=("resnet18", "resnet50"),
    arch="resnet50",
    batch=128,
    crop=224,
    resize=256,
    train_images=10_000,
    val_images=1_000,
    sides=(180, 320),
    epochs=4,
    step_warmup=10,
    step_rounds=5,
    step_steps=20,
    workers=None,
    reference_workers=4,
)
GPU_FULL = Plan(**{**asdict(GPU), "epochs": 6, "step_rounds": 10})
CPU_QUICK = Plan(
    device="cpu",
    step_archs=("resnet18",),
    arch="resnet18",
    batch=8,
    crop=64,
    resize=73,
    train_images=64,
    val_images=24,
    sides=(48, 96),
    epochs=2,
    step_warmup=1,
    step_rounds=2,
    step_steps=2,
    workers=2,
    reference_workers=2,
)


# --- the data: synthetic JPEGs as an ImageDirectory -------------------------------------------


def _write_image(job: tuple[Path, str, int, int, tuple[int, int]]) -> dict:
    """One JPEG: a smooth random colour field with a class tint and noise (so it compresses like
    a photo, not like a flat colour). Returns its manifest entry's fields."""
    import numpy as np
    from PIL import Image

    root, relative, label, index, (low, high) = job
    rng = np.random.default_rng(index)
    width, height = (int(v) for v in rng.integers(low, high + 1, size=2))
    coarse = rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC), np.float32)
    tint = np.array([(label * 37) % 256, (label * 91) % 256, (label * 53) % 256], np.float32)
    pixels = 0.7 * field + 0.3 * tint + rng.normal(0, 12, size=(height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
    data = buffer.getvalue()
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {
        "path": relative,
        "label": label,
        "sha256": hashlib.sha256(data).hexdigest(),
        "width": width,
        "height": height,
        "size": len(data),
    }


def make_image_directory(root: Path, count: int, first: int, plan: Plan) -> Path:
    """An ImageDirectory of ``count`` synthetic JPEGs (image seeds from ``first``), written by
    every core, with the manifest imageops's loaders read."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from tasks.data.imagedir import ImageEntry, Manifest, write_manifest

    classes = [f"class_{i}" for i in range(CLASSES)]
    jobs = [
        (root, f"{classes[i % CLASSES]}/{first + i:06d}.jpg", i % CLASSES, first + i, plan.sides)
        for i in range(count)
    ]
    context = multiprocessing.get_context("spawn")  # numpy and PIL only: quick to start
    with ProcessPoolExecutor(usable_cores(), mp_context=context) as pool:
        entries = [ImageEntry(**e) for e in pool.map(_write_image, jobs, chunksize=64)]
    counts = {c: sum(1 for e in entries if e.label == i) for i, c in enumerate(classes)}
    manifest = Manifest(
        labeled=True,
        classes=classes,
        counts=counts,
        images=entries,
        source="bench.gpu_train (synthetic JPEGs)",
    )
    write_manifest(root, manifest)
    return root


# --- the parts, each run in a fresh interpreter -----------------------------------------------


def _device(plan: Plan):
    import torch

    return torch.device(plan.device)


def _sync(plan: Plan) -> None:
    import torch

    if plan.device == "cuda":
        torch.cuda.synchronize()


def _spec(plan: Plan):
    from models.transform_spec import TransformSpec

    return TransformSpec(
        resize_size=plan.resize,
        center_crop_size=plan.crop,
        random_resized_crop=True,
        random_resized_crop_size=plan.crop,
        random_horizontal_flip=True,
    )


def _precision(plan: Plan) -> str:
    return "bf16" if plan.device == "cuda" else "fp32"


def _silent_log() -> logging.Logger:
    log = logging.getLogger("bench.gpu_train")
    log.addHandler(logging.NullHandler())
    log.propagate = False
    return log


class _StepRates(logging.Handler):
    """Keeps the training loop's progress lines as (step, images/s since the epoch began)."""

    def __init__(self) -> None:
        super().__init__()
        self.rates: list[tuple[int, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "[%d/%d]" in str(record.msg) and record.args:
            self.rates.append((int(record.args[2]), float(record.args[-1])))  # type: ignore[index]


def training_step(model, optimizer, amp, images, targets) -> Callable[[], None]:
    """One training step on a fixed batch, as the training loop does it (autocast, float32 loss,
    the gradient scaler, which is a pass-through unless fp16)."""
    import torch

    scaler = amp.grad_scaler()
    criterion = torch.nn.CrossEntropyLoss()
    images = images.contiguous(memory_format=amp.memory_format)
    model.train()

    def step() -> None:
        with amp.autocast():
            logits = model(images)
        loss = criterion(logits.float(), targets)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    return step


def time_steps(step: Callable[[], None], plan: Plan) -> list[float]:
    """images/s of each round of ``plan.step_steps`` steps, after the warm-up steps."""
    for _ in range(plan.step_warmup):
        step()
    _sync(plan)
    samples = []
    for _ in range(plan.step_rounds):
        began = time.perf_counter()
        for _ in range(plan.step_steps):
            step()
        _sync(plan)
        samples.append(plan.step_steps * plan.batch / (time.perf_counter() - began))
    return samples


def part_step(plan: Plan, data: Path) -> dict:
    """images/s of the model step alone on a synthetic batch on the device, per arch and mode."""
    import torch
    import torchvision

    from models.untrained import resnet
    from tasks.train.build import build_optimizer, configure_backends, prepare_model
    from tasks.train.params import TrainParams
    from tasks.train.precision import Amp

    device = _device(plan)
    configure_backends(device)
    rates: dict[str, list[float]] = {}
    for arch in plan.step_archs:
        for mode in ("fp32 NCHW", f"{_precision(plan)} channels-last"):
            torch.manual_seed(SEED)
            if mode == "fp32 NCHW":
                amp = Amp(device.type, "fp32", channels_last=False)
                model = torchvision.models.get_model(arch, num_classes=CLASSES).to(device)
                optimizer: torch.optim.Optimizer = torch.optim.SGD(
                    model.parameters(), LEARNING_RATE, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY
                )
            else:
                amp = Amp.for_run(device.type, _precision(plan), plan.crop)  # type: ignore[arg-type]
                model = prepare_model(
                    resnet(arch, pretrained=False), CLASSES, device, SEED, amp, plan.crop
                )
                optimizer = build_optimizer(
                    model, LEARNING_RATE, TrainParams(recipe=RECIPE).resolved()
                )
            images = torch.randn(plan.batch, 3, plan.crop, plan.crop, device=device)
            targets = torch.randint(0, CLASSES, (plan.batch,), device=device)
            step = training_step(model, optimizer, amp, images, targets)
            samples = time_steps(step, plan)
            rates[f"{arch}|{mode}"] = samples
            print(f"step {arch} {mode}: {statistics.median(samples):,.0f} images/s", flush=True)
            step = model = optimizer = None  # free the GPU memory before the next model
            if plan.device == "cuda":
                torch.cuda.empty_cache()
    return {"rates": rates}


def _datasets(plan: Plan, data: Path):
    from tasks.data.imagedir import read_manifest
    from tasks.data.transform import build_transform
    from tasks.train.data import ManifestImageFolder

    spec = _spec(plan)
    train, val = data / "train", data / "val"
    return (
        ManifestImageFolder(train, read_manifest(train), build_transform(spec, "training")),
        ManifestImageFolder(val, read_manifest(val), build_transform(spec, "inference")),
    )


def part_loader(plan: Plan, data: Path) -> dict:
    """The training loader alone: first batch (fork server's start included), then images/s."""
    from torch.utils.data import DataLoader

    from tasks.train.data import (
        LoaderSetup,
        ShardSampler,
        loader_workers,
        make_loader,
        training_loader,
    )

    device = _device(plan)
    train_set, val_set = _datasets(plan, data)
    workers = loader_workers(device, plan.workers)
    began = time.perf_counter()
    loader, sampler = training_loader(
        train_set,
        batch_size=plan.batch,
        seed=SEED,
        rank=0,
        world_size=1,
        setup=LoaderSetup(device, workers),
    )
    result: dict = {"workers": workers, "epochs": []}
    for epoch in (1, 2):
        sampler.set_epoch(epoch)
        if epoch == 2:
            began = time.perf_counter()
        batches = iter(loader)
        images, _ = next(batches)
        first = time.perf_counter() - began
        count, after_first = len(images), time.perf_counter()
        for images, _ in batches:
            count += len(images)
        rate = (count - plan.batch) / (time.perf_counter() - after_first)
        result["epochs"].append({"first_batch_s": first, "images_per_s": rate})
        print(f"loader epoch {epoch}: first batch {first:.2f} s, then {rate:,.0f} images/s")
    began = time.perf_counter()
    val_loader = make_loader(
        val_set,
        batch_size=plan.batch,
        sampler=ShardSampler(len(val_set), 0, 1),
        setup=LoaderSetup(device, workers),
    )
    next(iter(val_loader))
    result["val_first_batch_s"] = time.perf_counter() - began
    print(f"validation loader: first batch {result['val_first_batch_s']:.2f} s", flush=True)
    # References: how the same loader's processes start with the other start methods.
    for context, count in (("spawn", plan.reference_workers), ("fork", workers)):
        began = time.perf_counter()
        other = DataLoader(
            train_set,
            batch_size=plan.batch,
            shuffle=True,
            num_workers=count,
            multiprocessing_context=context,
            pin_memory=device.type == "cuda",
        )
        next(iter(other))
        result[f"{context}_first_batch_s"] = time.perf_counter() - began
        result[f"{context}_workers"] = count
        print(
            f"{context}, {count} processes: first batch {result[f'{context}_first_batch_s']:.2f} s"
        )
        del other
    return result


def part_imageops(plan: Plan, data: Path) -> dict:
    """The worker's epoch loop as a world of one: training images/s per epoch, first batch, wall.

    In the worker's order: the fork server starts before torch is imported; both loaders are
    prepared once the model is built.
    """
    from tasks.shared.fork_server import start_fork_server

    if plan.device == "cuda" or (plan.workers or 0) > 0:
        start_fork_server()  # as tasks.train.worker does, before its imports
    import torch

    from models.untrained import resnet
    from tasks.data.transform import input_size
    from tasks.train.build import build_optimizer, configure_backends, prepare_model
    from tasks.train.checkpoint import save_checkpoint
    from tasks.train.data import (
        LoaderSetup,
        ShardSampler,
        loader_workers,
        make_loader,
        training_loader,
    )
    from tasks.train.loop import (
        StepParts,
        check_weights,
        derive_seed,
        evaluate,
        seed_everything,
        train_one_epoch,
    )
    from tasks.train.params import TrainParams
    from tasks.train.precision import Amp
    from tasks.train.schedule import build_scheduler

    began = time.perf_counter()
    device = _device(plan)
    params = TrainParams(
        recipe=RECIPE, batch_size=plan.batch, learning_rate=LEARNING_RATE, epochs=plan.epochs
    )
    train_set, val_set = _datasets(plan, data)
    workers = loader_workers(device, plan.workers)
    loader, sampler = training_loader(
        train_set,
        batch_size=plan.batch,
        seed=SEED,
        rank=0,
        world_size=1,
        setup=LoaderSetup(device, workers),
    )
    val_loader = make_loader(
        val_set,
        batch_size=plan.batch,
        sampler=ShardSampler(len(val_set), 0, 1),
        setup=LoaderSetup(device, workers),
    )
    configure_backends(device)
    amp = Amp.for_run(device.type, _precision(plan), input_size(_spec(plan)))  # type: ignore[arg-type]
    size = input_size(_spec(plan))
    model = prepare_model(resnet(plan.arch, pretrained=False), CLASSES, device, SEED, amp, size)
    optimizer = build_optimizer(model, LEARNING_RATE, TrainParams(recipe=RECIPE).resolved())
    scaler = amp.grad_scaler()
    scheduler = build_scheduler(
        optimizer, steps_per_epoch=len(loader), epochs=plan.epochs, warmup_epochs=0
    )
    criterion = torch.nn.CrossEntropyLoss()
    parts = StepParts(optimizer, scheduler, criterion, scaler, amp, device)
    loader.prepare(1)
    val_loader.prepare()
    log = _silent_log()
    step_rates = _StepRates()
    log.addHandler(step_rates)
    log.setLevel(logging.INFO)  # the loop's progress lines are INFO
    result: dict = {
        "workers": workers,
        "set_up_s": time.perf_counter() - began,
        "since_start_s": time.perf_counter() - STARTED,
        "epochs": [],
    }
    for epoch in range(1, plan.epochs + 1):
        began = time.perf_counter()
        seed_everything(derive_seed(SEED, "epoch", 0, epoch))
        sampler.set_epoch(epoch)
        step_rates.rates = []
        stats = train_one_epoch(
            model,
            loader,
            parts,
            epoch=epoch,
            epochs=plan.epochs,
            print_frequency=params.print_frequency,
            log=log,
        )
        trained = time.perf_counter() - began
        check_weights(model, epoch, _precision(plan))
        val = evaluate(
            model, val_loader, device=device, num_classes=CLASSES, memory_format=amp.memory_format
        )
        validated = time.perf_counter() - began - trained
        save_checkpoint(
            data / "checkpoint.pt",
            {
                "epoch": epoch,
                "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
            },
        )
        wall = time.perf_counter() - began
        result["epochs"].append(
            {
                "images_per_s": stats.images_per_sec,
                "first_batch_s": stats.first_batch_seconds,
                "train_s": trained,
                "val_s": validated,
                "wall_s": wall,
                "step_rates": step_rates.rates,
                "loss": stats.loss,
                "val_top1": val["val/top1"],
            }
        )
        print(
            f"imageops epoch {epoch}: {stats.images_per_sec:,.0f} images/s (first batch after "
            f"{stats.first_batch_seconds:.2f} s), validation {validated:.2f} s, epoch {wall:.2f} s"
            f", loss {stats.loss:.3f}; images/s since the epoch began, by step: "
            + ", ".join(f"{step} {rate:,.0f}" for step, rate in step_rates.rates),
            flush=True,
        )
    return result


def part_plain(plan: Plan, data: Path) -> dict:
    """The pytorch/examples ImageNet loop, training only: images/s per epoch."""
    import torch
    import torchvision
    from torchvision import transforms

    from models.transform_spec import IMAGENET_MEAN, IMAGENET_STD
    from tasks.train.data import loader_workers

    device = _device(plan)
    workers = loader_workers(device, plan.workers)
    dataset = torchvision.datasets.ImageFolder(
        str(data / "train"),
        transforms.Compose(
            [
                transforms.RandomResizedCrop(plan.crop),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        ),
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=plan.batch,
        shuffle=True,
        num_workers=workers,
        pin_memory=device.type == "cuda",
    )
    torch.manual_seed(SEED)
    model = torchvision.models.get_model(plan.arch, num_classes=CLASSES).to(device)
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(
        model.parameters(), LEARNING_RATE, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY
    )
    result: dict = {"workers": workers, "epochs": []}
    for epoch in range(1, plan.epochs + 1):
        model.train()
        began = time.perf_counter()
        first, seen, loss_sum = 0.0, 0, 0.0
        for step, (images, targets) in enumerate(loader):
            if step == 0:
                first = time.perf_counter() - began
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            loss = criterion(model(images), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * images.size(0)  # the examples' AverageMeter, every step
            seen += images.size(0)
        _sync(plan)
        rate = seen / (time.perf_counter() - began)
        result["epochs"].append({"images_per_s": rate, "first_batch_s": first})
        print(f"plain epoch {epoch}: {rate:,.0f} images/s (first batch after {first:.2f} s)")
    return result


PARTS = {
    "step": part_step,
    "loader": part_loader,
    "imageops": part_imageops,
    "plain": part_plain,
}


def run_part(name: str, plan: Plan, data: Path) -> dict:
    """``python -m bench.gpu_train --part NAME`` in a fresh interpreter; its output streams."""
    out = data / f"part-{name}.json"
    command = [
        sys.executable,
        "-m",
        "bench.gpu_train",
        "--part",
        name,
        "--data",
        str(data),
        "--plan",
        json.dumps(asdict(plan)),
        "--out",
        str(out),
    ]
    print(f"\n--- {name} ---", flush=True)
    began = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench.gpu_train part {name} failed (exit {done.returncode})")
    result = json.loads(out.read_text())
    result["process_s"] = time.perf_counter() - began
    return result


# --- the report --------------------------------------------------------------------------------


def _verdict(value: float, goal: float, at_least: bool) -> str:
    met = value >= goal if at_least else value <= goal
    return "met" if met else "not met"


def describe_device(plan: Plan) -> str:
    import torch

    found = versions(("torch", "torchvision", "Pillow", "numpy", "pydantic"))
    soft = ", ".join(f"{k} {v}" for k, v in found.items())
    if plan.device == "cuda":
        gpu = f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    else:
        gpu = "no GPU: --device cpu, toy sizes (checks the script, measures nothing)"
    return f"{gpu}, {usable_cores()} usable cores; {soft}"


def report(plan: Plan, parts: dict[str, dict], command: str) -> Section:
    step, loader, ours, plain = (parts[k] for k in ("step", "loader", "imageops", "plain"))
    precision = _precision(plan)
    fast = f"{precision} channels-last"
    rates = {k: Stat(v, "images/s") for k, v in step["rates"].items()}
    step_rows: list[list] = []
    for arch in plan.step_archs:
        base = rates[f"{arch}|fp32 NCHW"]
        for mode in ("fp32 NCHW", fast):
            stat = rates[f"{arch}|{mode}"]
            ratio = (
                "1.00x"
                if mode == "fp32 NCHW"
                else Stat([b / a for a, b in zip(base.samples, stat.samples, strict=True)], "x")
            )
            step_rows.append([arch, mode, stat, ratio])
    ceiling = rates[f"{plan.arch}|{fast}"].median

    def epoch_stats(result: dict, key: str, first: bool) -> Stat:
        epochs = result["epochs"][:1] if first else result["epochs"][1:]
        return Stat([e[key] for e in epochs], "images/s" if key == "images_per_s" else "s")

    ours_first, ours_steady = (epoch_stats(ours, "images_per_s", f) for f in (True, False))
    plain_first, plain_steady = (epoch_stats(plain, "images_per_s", f) for f in (True, False))
    epoch_rows = [
        ["imageops", "1", ours_first, epoch_stats(ours, "first_batch_s", True),
         Stat([ours_first.median / ceiling * 100], "%")],
        [
            "imageops",
            f"2 to {plan.epochs}",
            ours_steady,
            epoch_stats(ours, "first_batch_s", False),
            Stat([r / ceiling * 100 for r in ours_steady.samples], "%"),
        ],
        ["plain (fp32 NCHW)", "1", plain_first, epoch_stats(plain, "first_batch_s", True),
         Stat([plain_first.median / ceiling * 100], "%")],
        [
            "plain (fp32 NCHW)",
            f"2 to {plan.epochs}",
            plain_steady,
            epoch_stats(plain, "first_batch_s", False),
            Stat([r / ceiling * 100 for r in plain_steady.samples], "%"),
        ],
    ]  # fmt: skip
    steady = ours_steady.median
    first_time = 1 / ours_first.median  # seconds per image: the same images every epoch
    goals = [
        [
            f"imageops steady epochs / {fast} step ceiling",
            f">= {GOAL_OF_CEILING:.0%}",
            f"{steady / ceiling:.1%}",
            _verdict(steady / ceiling, GOAL_OF_CEILING, at_least=True),
        ],
        [
            "imageops first epoch time / steady epoch time",
            f"<= {GOAL_FIRST_EPOCH:.1f}x",
            f"{first_time * steady:.2f}x",
            _verdict(first_time * steady, GOAL_FIRST_EPOCH, at_least=False),
        ],
        [
            "imageops steady / plain fp32 loop steady",
            f">= {GOAL_VS_PLAIN:.1f}x",
            f"{steady / plain_steady.median:.2f}x",
            _verdict(steady / plain_steady.median, GOAL_VS_PLAIN, at_least=True),
        ],
        [
            "imageops steady, 1 GPU / Azure docs' 8 V100 per GPU (1,670 / 8 = 209)",
            "",
            f"{steady / (SEED_8_V100 / 8):.1f}x",
            "",
        ],
    ]
    walls = [e["wall_s"] for e in ours["epochs"]]
    goals.insert(
        2,
        [
            "imageops whole first epoch (with validation, checkpoint) / steady whole epoch",
            "",
            f"{walls[0] / statistics.median(walls[1:]):.2f}x",
            "",
        ],
    )
    loader_rows = [
        [
            f"imageops (fork server), {loader['workers']} processes",
            Stat([loader["epochs"][0]["first_batch_s"]], "s"),
            Stat([loader["epochs"][1]["first_batch_s"]], "s"),
            Stat([loader["val_first_batch_s"]], "s"),
            Stat([e["images_per_s"] for e in loader["epochs"]], "images/s"),
        ],
        [
            f"spawn (the old default), {loader['spawn_workers']} processes",
            Stat([loader["spawn_first_batch_s"]], "s"),
            "",
            "",
            "",
        ],
        [
            f"fork, {loader['fork_workers']} processes",
            Stat([loader["fork_first_batch_s"]], "s"),
            "",
            "",
            "",
        ],
    ]
    text = [
        f"Device: {describe_device(plan)}. {plan.arch}, batch {plan.batch}, {plan.crop} px; "
        f"{plan.train_images:,} training and {plan.val_images:,} validation images (synthetic "
        f"JPEGs, {plan.sides[0]} to {plan.sides[1]} px a side, {CLASSES} classes), the ImageNet-"
        "style transform (RandomResizedCrop + flip; validation: resize "
        f"{plan.resize}, center crop {plan.crop}). Every part ran in a fresh interpreter.",
        f"**Model step alone** (synthetic batch already on the device; {plan.step_warmup} warm-up "
        f"steps, then {plan.step_rounds} rounds of {plan.step_steps} steps): `fp32 NCHW` is the "
        f"plain loop's step, `{fast}` imageops's (autocast, fused SGD).",
        f"**Training epochs** of {plan.arch}: `imageops` is the worker's epoch loop as a world of "
        f"one ({ours['workers']} loader processes, its default here): images/s is its "
        "`train/images_per_sec` (from the first batch asked for to the last step done; "
        "validation and the checkpoint not included: whole epochs took "
        f"{', '.join(f'{w:.1f}' for w in walls)} s with them); set-up before epoch 1 took "
        f"{ours['set_up_s']:.1f} s after the imports ({ours['since_start_s']:.1f} s after the "
        "interpreter started), in the worker's order: the fork server started before torch is "
        "imported, both loaders prepared once the model is built. "
        "`plain` is a pytorch/examples-style loop (ImageFolder, "
        f"{plain['workers']} forked loader processes, fp32 NCHW, the loss read every step). "
        f"'of ceiling' is against the {fast} step alone of {plan.arch} above.",
        "**Loader alone**: imageops's training loader (on CUDA its batches are uint8, made "
        "float and normalised on the GPU by the training step), each batch pinned, not copied to "
        "the device; the first batch of epoch 1 is timed from the loader's creation in a fresh "
        "process (the fork server's start and its one import of torch included); epoch 2's "
        "from the start of the epoch; the validation loader's from its creation afterwards. "
        "images/s counts from each epoch's first batch to its last.",
    ]
    tables = [
        Table(["arch", "step", "images/s", "vs fp32 NCHW"], step_rows, "Model step alone"),
        Table(
            ["loop", "epoch", "images/s", "first batch after", "of ceiling"],
            epoch_rows,
            "Training epochs",
        ),
        Table(
            [
                "loader",
                "first batch, epoch 1",
                "first batch, epoch 2",
                "validation's first batch",
                "images/s (epochs 1, 2)",
            ],
            loader_rows,
            "Loader alone",
        ),
        Table(["goal (issues 19, 30)", "wanted", "measured", ""], goals, "Goals"),
    ]
    return Section(
        key="gpu_train",
        title="GPU training speed",
        command=command,
        text=text,
        tables=tables,
    )


def run(plan: Plan, work: Path, command: str, raw: Path | None) -> Section:
    data = work / "data"
    began = time.perf_counter()
    make_image_directory(data / "train", plan.train_images, 0, plan)
    make_image_directory(data / "val", plan.val_images, plan.train_images, plan)
    print(f"wrote {plan.train_images + plan.val_images:,} JPEGs in "
          f"{time.perf_counter() - began:.1f} s", flush=True)  # fmt: skip
    parts = {name: run_part(name, plan, data) for name in PARTS}
    if raw is not None:  # every part's own figures, before anything can fail in the report
        raw.write_text(json.dumps({"plan": asdict(plan), "parts": parts}, indent=1))
    return report(plan, parts, command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="toy sizes (with --device cpu)")
    parser.add_argument("--raw", type=Path, help="also write every part's raw figures here (JSON)")
    parser.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.part:  # one part, in its own interpreter (run_part)
        fields = json.loads(args.plan)
        plan = Plan(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
        args.out.write_text(json.dumps(PARTS[args.part](plan, args.data)))
        return 0
    if args.device == "cuda" and no_cuda_here("gpu_train"):
        return 0
    full = "--full" in rest
    plan = CPU_QUICK if args.device == "cpu" else GPU_FULL if full else GPU
    if args.device == "cpu" and not args.quick:
        raise SystemExit("--device cpu runs the toy sizes only: add --quick")
    command = "python -m bench.gpu_train" + (" --full" if full else "")
    if args.device == "cpu":
        command += " --device cpu --quick"
    return run_main(
        lambda _full, work: run(plan, work, command, args.raw), __doc__.split("\n\n")[0], rest
    )


if __name__ == "__main__":
    sys.exit(main())
