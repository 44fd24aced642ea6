"""Train PyTorch Model: images/s of our training step vs a plain PyTorch loop, and 1 vs 2 processes.

Usage: ``python -m bench.train_speed [--full] [--json PATH]``

1. **Loop comparison**, in one process, at 224 px (scikit-learn's handwritten digits upscaled, as
   an ImageDirectory), batch 16, the same network and images for both sides:

   - ``plain``: the loop every PyTorch tutorial writes: torchvision ImageFolder + ToTensor +
     Normalize, a DataLoader, the model in NCHW and float32, SGD with momentum;
   - ``imageops``: the torchrun worker's own code called in-process as a world of one: its model
     and optimizer set-up (channels-last, fused SGD), its training loader and
     :func:`tasks.train.loop.train_one_epoch` under autocast in the precision ``auto`` resolves
     to on this machine (bf16 on a CPU that computes it natively);
   - ``imageops + torch.compile``: the same, with the network compiled (``compile: true``); the
     seconds compiling adds to the warm-up are reported.

   After a few untimed warm-up steps (oneDNN builds its kernels on the first calls), each round
   times a few steps of each loop, data loading included, one right after the other; "vs plain"
   is the per-round ratio. GFLOP/s counts a training step as 3x the forward FLOPs of
   :class:`torch.utils.flop_counter.FlopCounterMode` (the backward pass computes gradients for
   both inputs and weights); the runner sets them against the matmul peak of ``bench.ceiling``.

2. **Scaling**: training images/s with 1 and 2 processes, through the real launcher
   (:func:`tasks.train.launch.train`: ``torchrun --standalone``, DDP over gloo, an MLflow run per
   launch) on the same small-image data and settings. The figure is the rate the worker reports
   for its last epoch (``train/images_per_sec``: every rank's images over the slowest rank's
   time), which leaves out torchrun's start-up, validation and the first epoch's warm-up. Launches
   alternate between 1 and 2 processes; efficiency is the per-round 2-process rate over twice the
   1-process rate.

3. **Accuracy** (``--full`` only): the digits demo (resnet18 from scratch at 32 px, 5 epochs, one
   process, Azure's parameters otherwise) trained in fp32 and in bf16 for a few seeds through
   :func:`tasks.train.worker.train_worker`: bf16 must not cost validation top-1.

The quick default (resnet18 only, fewer rounds and launches, no accuracy check) takes about 2.5
minutes on 2 quiet cores; ``--full`` adds resnet50, more rounds, launches and images, and the
accuracy check. Run it on a quiet machine: a neighbour on one core slows a 2-thread process far
more than its share.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # `python bench/train_speed.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ceiling import forward_flops
from bench.report import Plot, Section, Series, Stat, Table, run_main, usable_cores

SIZE = 224  # the image size for the loop comparison
COMPILED = "imageops + torch.compile"
BATCH = 16
CLASSES = 10
LEARNING_RATE = 0.001
MOMENTUM = 0.9
# The engine's speed against a plain SGD loop, not the recipe's: the Azure recipe (SGD, no
# augmentation policy) is the plain loop's, and the one the recorded figures were measured with.
RECIPE = "azure"
SCALE_SIZE = 64  # small images: a launch's epochs stay short (from 64 px CPU runs use bf16)
SCALE_PROCESSES = (1, 2)
ACCURACY_SIZE = 32  # the digits demo's size
ACCURACY_EPOCHS = 5


@dataclass(frozen=True)
class Plan:
    """How much to measure: the quick default or ``--full``."""

    archs: tuple[str, ...]
    warmup: int  # untimed steps per loop before the first round
    rounds: int  # alternating rounds of the loop comparison
    steps: int  # timed steps per loop and round
    scale_rounds: int  # launches per world size, alternating
    # Training images of a scaling launch (plus 1/8 as many to validate); a multiple of 320:
    # 10 classes x 8/9, and whole batches of 16 for each of 2 processes.
    scale_images: int
    scale_epochs: int  # the last one's rate counts
    accuracy_seeds: tuple[int, ...]  # empty: no accuracy check


QUICK = Plan(
    archs=("resnet18",),
    warmup=2,
    rounds=3,
    steps=4,
    scale_rounds=2,
    scale_images=320,
    scale_epochs=2,
    accuracy_seeds=(),
)
FULL = Plan(
    archs=("resnet18", "resnet50"),
    warmup=2,
    rounds=5,
    steps=8,
    scale_rounds=5,
    scale_images=960,
    scale_epochs=2,
    accuracy_seeds=(1, 2, 3),
)


def make_images(root: Path, count: int, size: int) -> Path:
    """An ImageDirectory of at least ``count`` real digits (all 10 classes) at ``size`` px."""
    from tasks.data.convert import convert
    from tasks.data.sample import write_digits

    raw = write_digits(root / "raw", size=size, per_class=-(-count // CLASSES))
    convert(raw, root / "images")
    return root / "images"


def plain_loop(arch: str, root: Path) -> Callable[[int], float]:
    """The tutorial loop; returns ``run(steps) -> images/s`` over that many steps."""
    import torch
    import torchvision
    from torch.utils.data import DataLoader, Subset
    from torchvision import transforms

    from models.transform_spec import TransformSpec

    torch.manual_seed(0)
    model = torchvision.models.get_model(arch, num_classes=CLASSES)
    spec = TransformSpec()
    dataset = torchvision.datasets.ImageFolder(
        str(root),
        transform=transforms.Compose(
            [transforms.ToTensor(), transforms.Normalize(spec.mean, spec.std)]
        ),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    criterion = torch.nn.CrossEntropyLoss()

    def run(steps: int) -> float:
        loader = DataLoader(Subset(dataset, range(steps * BATCH)), batch_size=BATCH, shuffle=True)
        model.train()
        start = time.perf_counter()
        for images, targets in loader:
            loss = criterion(model(images), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return steps * BATCH / (time.perf_counter() - start)

    return run


def our_loop(
    arch: str, root: Path, precision: str, compiled: bool = False
) -> Callable[[int], float]:
    """The worker's training step, in-process; returns ``run(steps) -> images/s``. ``compiled``:
    the network under ``torch.compile``, as the worker runs it with ``compile: true``."""
    import torch
    from torch.utils.data import Subset

    from models.transform_spec import TransformSpec
    from models.untrained import resnet
    from tasks.data.imagedir import read_manifest
    from tasks.data.transform import build_transform
    from tasks.train.build import build_optimizer, configure_backends, prepare_model
    from tasks.train.data import LoaderSetup, ManifestImageFolder, training_loader
    from tasks.train.loop import StepParts, train_one_epoch
    from tasks.train.params import TrainParams
    from tasks.train.precision import Amp
    from tasks.train.schedule import build_scheduler

    device = torch.device("cpu")
    configure_backends(device)
    # Resize and center crop are no-ops on images already this size, as in plain_loop.
    spec = TransformSpec(resize_size=SIZE, center_crop_size=SIZE, random_horizontal_flip=False)
    dataset = ManifestImageFolder(root, read_manifest(root), build_transform(spec, "training"))
    amp = Amp.for_run(device.type, precision, SIZE)  # type: ignore[arg-type]
    model = prepare_model(resnet(arch, pretrained=False), CLASSES, device, 1, amp, SIZE)
    optimizer = build_optimizer(model, LEARNING_RATE, TrainParams(recipe=RECIPE).resolved())
    scaler = amp.grad_scaler()
    criterion = torch.nn.CrossEntropyLoss()
    net = torch.compile(model) if compiled else model
    log = logging.getLogger("bench.train_speed")
    log.addHandler(logging.NullHandler())
    log.propagate = False

    def run(steps: int) -> float:
        loader, sampler = training_loader(
            Subset(dataset, range(steps * BATCH)),
            batch_size=BATCH,
            seed=1,
            rank=0,
            world_size=1,
            setup=LoaderSetup(device, 0),  # 0: what loader_workers() gives on CPU
        )
        sampler.set_epoch(1)
        scheduler = build_scheduler(optimizer, steps_per_epoch=steps, epochs=1, warmup_epochs=0)
        stats = train_one_epoch(
            net,
            loader,
            StepParts(optimizer, scheduler, criterion, scaler, amp, device),
            epoch=1,
            epochs=1,
            print_frequency=10**9,
            log=log,
        )
        return stats.images_per_sec

    return run


def compare_loops(
    plan: Plan, precision: str, work: Path
) -> tuple[Table, dict[str, Stat], dict[str, float], dict[str, float]]:
    """The loops for each architecture (plain, ours, ours under torch.compile), alternating per
    round.

    Returns the table, the ``flops/...`` figures, each architecture's forward GFLOPs and the
    seconds torch.compile added to the warm-up (compiling) per architecture.
    """
    images = make_images(work / "loops", max(plan.warmup, plan.steps) * BATCH, SIZE)
    rows: list[list[str | float | int | Stat]] = []
    figures: dict[str, Stat] = {}
    forward: dict[str, float] = {}
    compile_seconds: dict[str, float] = {}
    for arch in plan.archs:
        flops = forward_flops(arch, SIZE, CLASSES)
        forward[arch] = flops / 1e9
        loops = {
            "plain": plain_loop(arch, images),
            "imageops": our_loop(arch, images, precision),
            COMPILED: our_loop(arch, images, precision, compiled=True),
        }
        warmup: dict[str, float] = {}
        for name, run in loops.items():
            start = time.perf_counter()
            run(plan.warmup)
            warmup[name] = time.perf_counter() - start
        compile_seconds[arch] = warmup[COMPILED] - warmup["imageops"]
        rates: dict[str, list[float]] = {name: [] for name in loops}
        for round_ in range(plan.rounds):  # a busy spell slows both sides of a round alike
            for name, run in loops.items():
                rates[name].append(run(plan.steps))
            print(
                f"{arch} round {round_ + 1}/{plan.rounds}: plain {rates['plain'][-1]:.1f}, "
                f"imageops {rates['imageops'][-1]:.1f}, compiled {rates[COMPILED][-1]:.1f} "
                "images/s",
                flush=True,
            )

        for name, dtype, ratio in (
            ("plain", "fp32", "1.00x"),
            ("imageops", precision, _versus(rates, "imageops")),
            (COMPILED, precision, _versus(rates, COMPILED)),
        ):
            achieved = [3 * flops * rate for rate in rates[name]]
            rows.append(
                [
                    arch,
                    name,
                    dtype,
                    Stat(rates[name], "images/s"),
                    Stat([v / 1e9 for v in achieved], "GFLOP/s"),
                    ratio,
                ]
            )
            label = "plain loop" if name == "plain" else name
            figures[f"flops/{dtype}/training {arch} {SIZE}px ({label})"] = Stat(achieved, "FLOP/s")
    table = Table(["arch", "loop", "precision", "images/s", "GFLOP/s", "vs plain"], rows)
    return table, figures, forward, compile_seconds


def _versus(rates: dict[str, list[float]], name: str) -> Stat:
    """``name``'s rate over the plain loop's, round by round."""
    return Stat([o / p for p, o in zip(rates["plain"], rates[name], strict=True)], "x")


def threads_per_process(processes: int) -> int:
    """Threads each training process computes with, by torchrun's rule.

    torchrun sets ``OMP_NUM_THREADS=1`` for every worker when it starts more than one per node
    and the variable is unset; a single worker keeps torch's default (one per core).
    """
    import torch

    if "OMP_NUM_THREADS" in os.environ:
        return int(os.environ["OMP_NUM_THREADS"])
    return 1 if processes > 1 else torch.get_num_threads()


@dataclass
class Scaling:
    """What the scaling launches measured, and on what."""

    rates: dict[int, list[float]]  # per world size, in launch order: round r is rates[n][r]
    precision: str  # what the launcher resolved ``auto`` to
    train_images: int
    val_images: int


def threads_note() -> str:
    """The threads each process of the scaling runs computes with, in words."""
    cores = usable_cores()
    one, two = threads_per_process(1), threads_per_process(2)
    if "OMP_NUM_THREADS" in os.environ:
        why = f"`OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}` is set"
    else:
        why = f"1 process keeps torch's default ({one}); with 2, torchrun sets `OMP_NUM_THREADS=1`"
    note = (
        f"Threads per process: {why}, so it is 1 x {one} against 2 x {two} threads on "
        f"{cores} usable cores; the efficiency includes DDP's gradient all-reduce."
    )
    if one >= cores:  # the second process brings no core of its own
        note += (
            " One process already computes on every core, so 2 processes share the same cores: "
            "about 50% is the expected efficiency here, and the ideal (linear) line is what 2 "
            "processes with cores of their own would reach."
        )
    return note


def scaling(plan: Plan, work: Path) -> Scaling:
    """Launch real torchrun trainings with 1 and 2 processes; each launch's last-epoch images/s."""
    from models.transform_spec import TransformSpec
    from models.untrained import resnet, write_untrained
    from tasks.data.convert import convert
    from tasks.data.imagedir import read_manifest
    from tasks.data.sample import write_digits
    from tasks.data.split import split
    from tasks.shared.settings import Settings
    from tasks.train.launch import train
    from tasks.train.loop import THROUGHPUT
    from tasks.train.params import TrainParams
    from tasks.train.request import TrainRequest

    root = work / "scaling"
    settings = Settings(project_root=root / "project", home=Path(".imageops")).apply()
    # Per class 8/9 to train, 1/9 to validate: exactly scale_images training images.
    per_class = plan.scale_images // CLASSES * 9 // 8
    raw = write_digits(root / "raw", size=SCALE_SIZE, per_class=per_class)
    convert(raw, root / "images")
    split(root / "images", root / "train", root / "val", fraction=8 / 9, seed=1)
    untrained = write_untrained(resnet("resnet18", pretrained=False), root / "untrained")
    transform = TransformSpec(
        resize_size=SCALE_SIZE, center_crop_size=SCALE_SIZE, random_horizontal_flip=False
    )
    rates: dict[int, list[float]] = {n: [] for n in SCALE_PROCESSES}
    precision = ""
    for round_ in range(plan.scale_rounds):
        # Alternate which world size goes first, so a slow spell does not favour one of them.
        order = SCALE_PROCESSES if round_ % 2 == 0 else SCALE_PROCESSES[::-1]
        for processes in order:
            params = TrainParams(
                recipe=RECIPE,
                epochs=plan.scale_epochs,
                batch_size=BATCH,
                learning_rate=LEARNING_RATE,
                seed=1,
                device="cpu",
                precision="auto",
                nproc_per_node=processes,
                print_frequency=10**6,
            )
            output = io.StringIO()
            began = time.perf_counter()
            try:
                with contextlib.redirect_stdout(output):  # torchrun's and the workers' lines
                    request = TrainRequest(
                        model=untrained,
                        train_data=root / "train",
                        val_data=root / "val",
                        out=root / f"model-{processes}-{round_}",
                        params=params,
                        transform=transform,
                    )
                    result = train(request, settings)
            except BaseException:
                print(output.getvalue()[-4000:], flush=True)
                raise
            rate = result.history[-1][THROUGHPUT]
            rates[processes].append(rate)
            precision = json.loads((result.run_dir / "config.json").read_text())["precision"]
            print(
                f"scaling round {round_ + 1}/{plan.scale_rounds}, {processes} process(es): "
                f"{rate:.1f} images/s (launch {time.perf_counter() - began:.0f} s)",
                flush=True,
            )
    return Scaling(
        rates,
        precision,
        len(read_manifest(root / "train").images),
        len(read_manifest(root / "val").images),
    )


def scaling_parts(rates: dict[int, list[float]]) -> tuple[Table, Plot]:
    """The scaling table and plot; efficiency is per round: rate(2) / (2 x rate(1))."""
    one = rates[1]
    rows: list[list[str | float | int | Stat]] = []
    for n in SCALE_PROCESSES:
        efficiency: str | Stat = (
            "100% (the reference)"
            if n == 1
            else Stat([100 * r / (n * b) for b, r in zip(one, rates[n], strict=True)], "%")
        )
        rows.append(
            [
                n,
                Stat(rates[n], "images/s"),
                Stat([r / n for r in rates[n]], "images/s"),
                efficiency,
            ]
        )
    table = Table(["processes", "images/s", "per process", "efficiency"], rows)
    xs = [float(n) for n in SCALE_PROCESSES]
    plot = Plot(
        file="bench-train.png",
        title=f"Training resnet18 at {SCALE_SIZE} px through torchrun (gloo), CPU",
        x_label="processes",
        panels=[
            (
                "images/s",
                [
                    Series("measured", xs, [Stat(rates[n], "images/s") for n in SCALE_PROCESSES]),
                    Series(
                        "ideal (linear)",
                        xs,
                        [Stat([n * b for b in one], "images/s") for n in SCALE_PROCESSES],
                    ),
                ],
            )
        ],
    )
    return table, plot


def digits_top1(root: Path, precision: str, seed: int) -> float:
    """Best validation top-1 of the digits demo trained by the worker in-process with ``seed``."""
    from flows.config import DEMO_TRANSFORM
    from models.untrained import resnet
    from tasks.data.convert import convert
    from tasks.data.imagedir import read_manifest
    from tasks.data.sample import write_digits
    from tasks.data.split import split
    from tasks.train.params import RunConfig, TrainParams, manifest_fingerprint
    from tasks.train.worker import train_worker

    data = root / "digits"
    if not (data / "train").is_dir():
        convert(write_digits(data / "raw", size=ACCURACY_SIZE), data / "images")
        split(data / "images", data / "train", data / "val", fraction=0.9, seed=1)
    run = root / f"run-{precision}-{seed}"
    config = RunConfig(
        params=TrainParams(
            recipe=RECIPE, epochs=ACCURACY_EPOCHS, seed=seed, device="cpu", precision=precision
        ),
        architecture=resnet("resnet18", pretrained=False),
        classes=read_manifest(data / "train").classes,
        transform=DEMO_TRANSFORM,
        train_data=data / "train",
        val_data=data / "val",
        data_fingerprint={role: manifest_fingerprint(data / role) for role in ("train", "val")},
        out=run / "model",
        run_dir=run,
        device="cpu",
        precision=precision,
        world_size=1,
    )
    # The worker logs every 10 iterations to stdout; its rank_0.log keeps them.
    with contextlib.redirect_stdout(io.StringIO()):
        result = train_worker(config)
    return result["metrics"]["val/top1"]


def accuracy(seeds: tuple[int, ...], precisions: tuple[str, ...], work: Path) -> Table:
    """The digits demo in each precision for each seed; bf16's cost is a per-seed difference."""
    top1: dict[str, list[float]] = {p: [] for p in precisions}
    for seed in seeds:
        for precision in precisions:
            top1[precision].append(100 * digits_top1(work / "accuracy", precision, seed))
            print(f"accuracy seed {seed} {precision}: {top1[precision][-1]:.2f}%", flush=True)
    rows: list[list[str | float | int | Stat]] = []
    for precision in precisions:
        versus: str | Stat = (
            "0 (the reference)"
            if precision == "fp32"
            else Stat([b - f for f, b in zip(top1["fp32"], top1[precision], strict=True)], "pp")
        )
        rows.append([precision, Stat(top1[precision], "%"), versus])
    return Table(["precision", "best validation top-1", "vs fp32 (same seed)"], rows)


def run(full: bool, work: Path) -> Section:
    import torch

    from tasks.train.precision import cpu_bf16_runs, precision_choice

    plan = FULL if full else QUICK
    threads = torch.get_num_threads()
    precision, why = precision_choice("auto", "cpu", SIZE)

    loops, figures, forward, compile_seconds = compare_loops(plan, precision, work)
    scaled = scaling(plan, work)
    scale_table, plot = scaling_parts(scaled.rates)
    tables = [loops, scale_table]

    flops = ", ".join(f"{arch} {g:.2f}" for arch, g in forward.items())
    text = [
        f"**Training step**, one process with {threads} threads, {SIZE}x{SIZE} px digits, batch "
        f"{BATCH}: `plain` is the tutorial loop (ImageFolder, NCHW, float32, SGD with momentum); "
        "`imageops` is the torchrun worker's own step in-process (channels-last, autocast, fused "
        f"SGD), in the precision `auto` picks here at {SIZE} px: {precision} ({why}). "
        f"{plan.warmup} untimed warm-up steps per loop, then {plan.rounds} rounds of "
        f"{plan.steps} timed steps ({plan.steps * BATCH} images, loading included) per loop, the "
        "loops one after the other in each round; vs plain is the per-round ratio. GFLOP/s = "
        f"images/s x 3 x the forward GFLOPs per image ({flops}). `{COMPILED}` is the same step "
        "with the network under `torch.compile` (TorchInductor, default mode), as the worker "
        "runs it with `compile: true`; compiling added "
        + ", ".join(f"{s:.0f} s ({arch})" for arch, s in compile_seconds.items())
        + " to the warm-up, paid once per training process.",
        f"**Scaling**: resnet18 at {SCALE_SIZE}x{SCALE_SIZE} px trained through "
        "`tasks.train.launch.train` (`torchrun --standalone`, DDP over gloo, an MLflow run per "
        f"launch), {scaled.train_images} training and {scaled.val_images} validation images, "
        f"batch {BATCH} per process (the global batch and learning rate grow with the "
        f"processes), {plan.scale_epochs} epochs, precision auto ({scaled.precision}). images/s "
        "is the worker's `train/images_per_sec` of the last epoch (every rank's images over the "
        "slowest rank's time), so torchrun's start-up, validation and the first epoch's warm-up "
        f"are left out. {plan.scale_rounds} launches per process count, alternating; efficiency "
        f"= per-round 2-process rate / (2 x 1-process rate). {threads_note()}",
    ]
    if plan.accuracy_seeds:
        precisions = ("fp32", "bf16") if cpu_bf16_runs() else ("fp32",)
        tables.append(accuracy(plan.accuracy_seeds, precisions, work))
        text.append(
            f"**Accuracy**: the digits demo (resnet18 from scratch at {ACCURACY_SIZE} px, "
            f"{ACCURACY_EPOCHS} epochs, 1 process, Azure's parameters otherwise) trained in "
            f"{' and '.join(precisions)} (asked for: `auto` keeps inputs under 64 px in fp32) "
            f"with seeds {', '.join(map(str, plan.accuracy_seeds))}; pp = percentage points"
            + ("." if cpu_bf16_runs() else "; bf16 autocast does not run on this CPU.")
        )
    else:
        text.append(
            "**Accuracy** (digits demo, fp32 vs bf16): skipped in the quick run; "
            "`python -m bench.train_speed --full` runs it."
        )
    return Section(
        key="train",
        title="Train PyTorch Model: training speed",
        command=f"python -m bench.train_speed{' --full' if full else ''}",
        text=text,
        tables=tables,
        plots=[plot],
        figures=figures,
    )


if __name__ == "__main__":
    sys.exit(run_main(run, __doc__.split("\n\n")[0]))
