"""Train PyTorch Model: images/s of our training step against a plain PyTorch loop, in one process.

Usage: ``python bench/train_speed.py [--archs resnet18 resnet50] [--batch-size 16] [--iters 5]``
(``--help`` lists the rest: ``--size``, ``--precision``, the accuracy part's options).

On the same images (scikit-learn's handwritten digits upscaled to 224x224, or ``--size``, as an
ImageDirectory), the same network, batch size and image size, it times

- ``plain``: the loop every PyTorch tutorial writes: torchvision ImageFolder + ToTensor + Normalize,
  a DataLoader, the model in NCHW and float32, SGD with momentum;
- ``imageops``: the code the torchrun worker runs, called in-process as a world of one: the
  worker's model and optimizer set-up (channels-last), the training loader
  (:func:`tasks.train.data.training_loader`), the precision ``auto`` resolves to on this machine
  (or ``--precision``), and :func:`tasks.train.loop.train_one_epoch`, which reports the images/s.

Each side runs ``--warmup`` iterations (oneDNN builds its kernels on the first calls), then
``--iters`` timed iterations, data loading included; sides alternate over ``--rounds`` rounds and
the best round of each counts (the one least disturbed by anything else on the machine).

It also measures the machine's matrix-multiply peak in float32 and bfloat16 (square ``torch.matmul``
of ``--matmul-size``), counts each network's forward FLOPs with
:class:`torch.utils.flop_counter.FlopCounterMode` (a training step is about 3x the forward: the
backward pass computes gradients for both inputs and weights), and prints each loop's FLOP/s as a
fraction of the peak of the precision it computes in.

Last, unless ``--accuracy-epochs 0``, it trains the digits demo (resnet18 from scratch at 32x32,
or ``--accuracy-size``; the seed's default parameters, one process) once in fp32 and once in bf16
(asked for: ``auto`` keeps inputs under 64 px in fp32), through
:func:`tasks.train.worker.train_worker`, and prints both validation top-1 values: bf16 must not
cost accuracy.

Run it on a quiet machine; it prints the load average before and after. The default run takes
about 3 to 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# `python bench/train_speed.py` puts bench/ on sys.path, not the project root.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torchvision  # noqa: E402
from torch.utils.data import DataLoader, Subset  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from torchvision import transforms  # noqa: E402

from models.transform_spec import TransformSpec  # noqa: E402
from models.zoo import resnet  # noqa: E402
from tasks.imagedir import read_manifest  # noqa: E402
from tasks.train.data import ManifestImageFolder, training_loader  # noqa: E402
from tasks.train.loop import train_one_epoch  # noqa: E402
from tasks.train.precision import Amp, cpu_bf16_speedup, resolve_precision  # noqa: E402
from tasks.train.schedule import build_scheduler  # noqa: E402
from tasks.train.worker import build_optimizer, configure_backends, prepare_model  # noqa: E402
from tasks.transform import build_transform  # noqa: E402

SIZE = 224  # the image size; --size changes it
CLASSES = 10
LEARNING_RATE = 0.001
MOMENTUM = 0.9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--archs", nargs="*", default=["resnet18", "resnet50"], help="none: accuracy only"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="images per step (16)")
    parser.add_argument("--size", type=int, default=SIZE, help=f"image side, px ({SIZE})")
    parser.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="imageops loop's precision (auto: what training picks at --size)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    parser.add_argument("--iters", type=int, default=5, help="timed steps per round (5)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds, best kept (2)")
    parser.add_argument("--matmul-size", type=int, default=2048, help="side of the matmul (2048)")
    parser.add_argument(
        "--accuracy-epochs", type=int, default=5, help="digits demo epochs per precision; 0: skip"
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[1], help="digits demo random seeds (1)"
    )
    parser.add_argument(
        "--accuracy-size", type=int, default=32, help="digits demo image side, px (32)"
    )
    args = parser.parse_args(argv)
    for name in ("batch_size", "size", "warmup", "iters", "rounds", "matmul_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.accuracy_epochs < 0:
        parser.error("--accuracy-epochs must be >= 0")
    if args.accuracy_size < 32:
        parser.error("--accuracy-size must be >= 32 (bf16 on CPU needs 32 px or more)")
    return args


def make_images(root: Path, count: int, size: int) -> Path:
    """An ImageDirectory of ``count`` real digits (all 10 classes) upscaled to ``size`` px."""
    from tasks.convert import convert
    from tasks.sample import write_digits

    raw = write_digits(root / "raw", size=size, per_class=-(-count // CLASSES))
    convert(raw, root / "images")
    return root / "images"


def matmul_peak(dtype: torch.dtype, n: int, seconds: float = 2.0) -> float:
    """Best FLOP/s of an n x n x n ``torch.matmul`` in ``dtype`` over about ``seconds``."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(dtype)
    b = torch.randn(n, n, generator=generator).to(dtype)
    for _ in range(2):
        torch.matmul(a, b)
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def forward_flops(arch: str, size: int) -> int:
    """FLOPs of one forward pass of ``arch`` on one ``size`` x ``size`` image."""
    model = torchvision.models.get_model(arch, num_classes=CLASSES).eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.zeros(1, 3, size, size))
    return counter.get_total_flops()


def plain_loop(arch: str, root: Path, batch_size: int) -> Callable[[int], float]:
    """The tutorial loop; returns ``run(steps) -> images/s`` over that many steps."""
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
        loader = DataLoader(
            Subset(dataset, range(steps * batch_size)), batch_size=batch_size, shuffle=True
        )
        model.train()
        start = time.perf_counter()
        for images, targets in loader:
            loss = criterion(model(images), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return steps * batch_size / (time.perf_counter() - start)

    return run


def our_loop(
    arch: str, root: Path, batch_size: int, precision: str, size: int
) -> Callable[[int], float]:
    """The worker's training step, in-process; returns ``run(steps) -> images/s``."""
    device = torch.device("cpu")
    configure_backends(device)
    # Resize and center crop are no-ops on images already this size, as in plain_loop.
    spec = TransformSpec(resize_size=size, center_crop_size=size, random_horizontal_flip=False)
    dataset = ManifestImageFolder(root, read_manifest(root), build_transform(spec, "training"))
    amp = Amp.for_run(device.type, precision, size)  # type: ignore[arg-type]
    model = prepare_model(resnet(arch, pretrained=False), CLASSES, device, seed=1, amp=amp)
    optimizer = build_optimizer(model, LEARNING_RATE)
    scaler = amp.grad_scaler()
    criterion = torch.nn.CrossEntropyLoss()
    log = logging.getLogger("bench.train_speed")
    log.addHandler(logging.NullHandler())
    log.propagate = False

    def run(steps: int) -> float:
        loader, sampler = training_loader(
            Subset(dataset, range(steps * batch_size)),
            batch_size=batch_size,
            seed=1,
            rank=0,
            world_size=1,
            device=device,
            num_workers=0,  # what loader_workers() gives on CPU
        )
        sampler.set_epoch(1)
        scheduler = build_scheduler(optimizer, steps_per_epoch=steps, epochs=1, warmup_epochs=0)
        stats = train_one_epoch(
            model,
            loader,
            optimizer=optimizer,
            scheduler=scheduler,
            criterion=criterion,
            device=device,
            amp=amp,
            scaler=scaler,
            epoch=1,
            epochs=1,
            print_frequency=10**9,
            log=log,
        )
        return stats.images_per_sec

    return run


def digits_top1(
    root: Path, precision: str, epochs: int, seed: int, size: int
) -> tuple[float, list[float], float]:
    """The digits demo trained by the worker in-process with ``seed``, at ``size`` px.

    Returns (best validation top-1, top-1 of each epoch, seconds).
    """
    from flows.config import DEMO_TRANSFORM
    from tasks.convert import convert
    from tasks.sample import write_digits
    from tasks.split import split
    from tasks.train.params import RunConfig, TrainParams, manifest_fingerprint
    from tasks.train.worker import train_worker

    data = root / f"digits{size}"
    if not (data / "train").is_dir():
        convert(write_digits(data / "raw", size=size), data / "images")
        split(data / "images", data / "train", data / "val", fraction=0.9, seed=1)
    run = root / f"run-{size}-{precision}-{seed}"
    # The demo's transform (resize and center crop, no flip) at this size.
    sizes = ("resize_size", "center_crop_size", "random_resized_crop_size", "random_crop_size")
    transform = DEMO_TRANSFORM.model_copy(update=dict.fromkeys(sizes, size))
    config = RunConfig(
        params=TrainParams(epochs=epochs, seed=seed, device="cpu", precision=precision),
        architecture=resnet("resnet18", pretrained=False),
        classes=read_manifest(data / "train").classes,
        transform=transform,
        train_data=data / "train",
        val_data=data / "val",
        data_fingerprint={role: manifest_fingerprint(data / role) for role in ("train", "val")},
        out=run / "model",
        run_dir=run,
        device="cpu",
        precision=precision,
        world_size=1,
    )
    start = time.perf_counter()
    # The worker logs every 10 iterations to stdout; its rank_0.log keeps them.
    with contextlib.redirect_stdout(io.StringIO()):
        result = train_worker(config)
    history = [epoch["val/top1"] for epoch in result["history"]]
    return result["metrics"]["val/top1"], history, time.perf_counter() - start


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def speed_table(args: argparse.Namespace, precision: str, root: Path) -> None:
    """Time both loops for each of ``args.archs`` and print the table (Markdown).

    The matmul peak is measured before and after the loops and the higher value kept: a peak
    taken while something else had a core would make every fraction of it look too good.
    """
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    peaks = {name: matmul_peak(dtype, args.matmul_size) for name, dtype in dtypes.items()}
    images = make_images(root, max(args.warmup, args.iters) * args.batch_size, args.size)
    rows = []
    for arch in args.archs:
        flops = 3 * forward_flops(arch, args.size)
        loops = {
            "plain": (plain_loop(arch, images, args.batch_size), "fp32"),
            "imageops": (
                our_loop(arch, images, args.batch_size, precision, args.size),
                precision,
            ),
        }
        best = dict.fromkeys(loops, 0.0)
        for run, _ in loops.values():
            run(args.warmup)
        for _ in range(args.rounds):  # alternating: a busy spell slows both sides alike
            for name, (run, _) in loops.items():
                best[name] = max(best[name], run(args.iters))
        for name, (_, dtype) in loops.items():
            rate = best[name] * flops
            rows.append((arch, name, dtype, best[name], rate, best["plain"]))
    for name, dtype in dtypes.items():
        peaks[name] = max(peaks[name], matmul_peak(dtype, args.matmul_size))
    print(
        f"matmul peak ({args.matmul_size}^3, best before/after): fp32 "
        f"{peaks['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s"
    )
    print(
        f"\ntraining step, batch {args.batch_size}, {args.size}x{args.size}, best of {args.rounds} "
        f"rounds of {args.iters} steps (after {args.warmup} warm-up steps)"
    )
    header = ("arch", "loop", "precision", "images/s", "GFLOP/s", "of peak", "vs plain")
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for arch, name, dtype, images_per_sec, flops_per_sec, plain in rows:
        print(
            f"| {arch} | {name} | {dtype} | {images_per_sec:.1f} | {flops_per_sec / 1e9:.0f} | "
            f"{100 * flops_per_sec / peaks[dtype]:.0f}% of {dtype} | "
            f"{images_per_sec / plain:.2f}x |"
        )


def accuracy(args: argparse.Namespace, precisions: tuple[str, ...], root: Path) -> None:
    """Train the digits demo in each precision for each of ``args.seeds``; print top-1."""
    print(
        f"\ndigits demo (resnet18, {args.accuracy_size}x{args.accuracy_size}, "
        f"{args.accuracy_epochs} epochs, the seed's defaults "
        "otherwise, 1 process): best validation top-1 (each epoch's)"
    )
    for seed in args.seeds:
        for precision in precisions:
            top1, history, seconds = digits_top1(
                root, precision, args.accuracy_epochs, seed, args.accuracy_size
            )
            epochs = ", ".join(f"{100 * value:.2f}" for value in history)
            print(f"  seed {seed} {precision}: {100 * top1:.2f}% ({epochs}) in {seconds:.0f} s")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    began = time.perf_counter()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    precision = resolve_precision(args.precision, "cpu", args.size)
    speedup = cpu_bf16_speedup()
    print(
        f"machine: {cpu_name()}, {cores} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; load average {load()}"
    )
    print(
        f"precision {args.precision} at {args.size} px -> {precision} (bf16 probe: "
        f"{'fails' if speedup is None else f'{speedup:.2f}x fp32'})"
    )
    with tempfile.TemporaryDirectory(prefix="imageops-bench-") as tmp:
        if args.archs:
            speed_table(args, precision, Path(tmp))
        if args.accuracy_epochs:
            accuracy(args, ("fp32", "bf16") if speedup is not None else ("fp32",), Path(tmp))
    print(f"\nload average {load()}; whole benchmark {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
