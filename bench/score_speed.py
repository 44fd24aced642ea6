"""Score Image Model: images/s of torch eager fp32, ONNX Runtime fp32 and INT8, in one run.

Usage: ``python bench/score_speed.py [--size 224] [--epochs 1] [--batch-size 64] [--passes 2]``
(``--help`` lists the rest: ``--learning-rate``, ``--max-top1-drop``, ``--parts``, the memory
part's ``--memory-images`` and ``--memory-size``).

It writes scikit-learn's 1,797 real handwritten digits at ``--size`` px as an ImageDirectory,
splits it 80/20 (seeded, stratified), trains resnet18 from scratch on the 80% with the torchrun
worker's own code (:func:`tasks.train.worker.train_worker`, in-process, one rank, the demo's
transform at ``--size``, learning rate 0.01), exports it (:func:`tasks.export.export_onnx`,
parity-checked) and quantizes it (:func:`tasks.quantize.quantize`: static INT8, QDQ, calibrated
on 256 training images, gated at ``--max-top1-drop`` points). Then, on the same validation
images and batch size, decoding and the inference transform included, it times

- ``torch eager fp32``: the model from the ModelDirectory in ``eval()`` under
  ``torch.inference_mode()``, the images read with the same ``load_rgb`` and transform;
- ``ONNX Runtime fp32``: :func:`tasks.score.score` as a user runs it (session start-up and the
  scored CSV included);
- ``ONNX Runtime INT8``: the same with ``quantized=True``.

The validation images are split in four stratified quarters; after an untimed torch warm-up,
each round has every engine score one quarter, one right after the other, and ``--passes``
passes go over all four. The table shows each engine's best round in images/s (the one least
disturbed by anything else on the machine), the ratio to torch eager as the median of the
per-round ratios (runs seconds apart, so a busy neighbour slows both sides alike) and best
against best, and each engine's top-1 over all its rounds (every validation image, ``--passes``
times). A last line times the engines alone on one decoded batch.

Last, the memory part: :func:`tasks.score.score` over ``--memory-images`` images (default 1,000 and
20,000: the digit scans at ``--memory-size`` px written again and again into one folder), each in a
fresh subprocess that reports its own peak RSS (``VmHWM``), so no figure includes another's.
The default run takes about 5 minutes on 2 quiet cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# `python bench/score_speed.py` puts bench/ on sys.path, not the project root.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GOAL_FP32 = 1.5  # ONNX Runtime fp32 against torch eager, the goals
GOAL_INT8 = 3.0
GOAL_DROP = 0.5  # top-1 points INT8 may lose
GOAL_MEMORY_MB = 100.0
SIDES = ("torch eager fp32", "ONNX Runtime fp32", "ONNX Runtime INT8")
QUARTERS = 4  # the validation images are timed a quarter per round


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=224, help="image side, px (224)")
    parser.add_argument("--epochs", type=int, default=1, help="training epochs (1)")
    parser.add_argument(
        "--learning-rate", type=float, default=0.01, help="training learning rate (0.01)"
    )
    parser.add_argument("--batch-size", type=int, default=64, help="scoring batch (64)")
    parser.add_argument(
        "--passes", type=int, default=2, help="timed passes over the validation images (2)"
    )
    parser.add_argument(
        "--max-top1-drop", type=float, default=GOAL_DROP, help=f"INT8 gate ({GOAL_DROP})"
    )
    parser.add_argument(
        "--memory-images",
        type=int,
        nargs="*",
        default=[1000, 20000],
        help="image counts of the memory part (1000 20000); none: skip it",
    )
    parser.add_argument(
        "--memory-size", type=int, default=32, help="image side of the memory part, px (32)"
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=("speed", "memory"),
        default=["speed", "memory"],
        help="which parts to run (both)",
    )
    # The memory part's subprocess: MODEL IMAGES DEST QUANTIZED (not for people).
    parser.add_argument("--memory-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("size", "epochs", "batch_size", "passes", "memory_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.size, args.memory_size) < 32:
        parser.error("--size and --memory-size must be >= 32 (resnet18 needs 32 px)")
    return args


def make_digits(root: Path, size: int) -> tuple[Path, Path, list[Path]]:
    """(train, val, val's quarters): all 1,797 digits at ``size`` px, split 80/20.

    The quarters are ``val`` split in four stratified ImageDirectories (two seeded halvings):
    one timed round scores one quarter with every engine.
    """
    from tasks.convert import convert
    from tasks.sample import write_digits
    from tasks.split import split

    convert(write_digits(root / "raw", size=size), root / "images")
    split(root / "images", root / "train", root / "val", fraction=0.8, seed=1)
    split(root / "val", root / "half-0", root / "half-1", fraction=0.5, seed=1)
    for half in (0, 1):
        quarters = (root / f"quarter-{2 * half}", root / f"quarter-{2 * half + 1}")
        split(root / f"half-{half}", *quarters, fraction=0.5, seed=1)
    shutil.rmtree(root / "raw")
    return root / "train", root / "val", [root / f"quarter-{i}" for i in range(QUARTERS)]


def train_model(
    root: Path, train: Path, val: Path, size: int, epochs: int, learning_rate: float
) -> Path:
    """resnet18 trained from scratch by the worker in-process; returns the ModelDirectory.

    The learning rate is ten times the seed's default: from scratch at 224 px, one epoch at 0.001
    reached 53% validation top-1 here, one at 0.01 93%; a model that guesses half the time
    would make the INT8 top-1 drop a coin toss.
    """
    from flows.config import DEMO_TRANSFORM
    from models.zoo import resnet
    from tasks.imagedir import read_manifest
    from tasks.train.params import RunConfig, TrainParams, manifest_fingerprint
    from tasks.train.precision import resolve_precision
    from tasks.train.worker import train_worker

    sizes = ("resize_size", "center_crop_size", "random_resized_crop_size", "random_crop_size")
    config = RunConfig(
        params=TrainParams(epochs=epochs, seed=1, device="cpu", learning_rate=learning_rate),
        architecture=resnet("resnet18", pretrained=False),
        classes=read_manifest(train).classes,
        transform=DEMO_TRANSFORM.model_copy(update=dict.fromkeys(sizes, size)),
        train_data=train,
        val_data=val,
        data_fingerprint={"train": manifest_fingerprint(train), "val": manifest_fingerprint(val)},
        out=root / "run" / "model",
        run_dir=root / "run",
        device="cpu",
        precision=resolve_precision("auto", "cpu", size),  # what `imageops train` would pick
        world_size=1,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # the worker logs to stdout and rank_0.log
        train_worker(config)
    return config.out


def torch_eager(model_dir: Path, images: Path, batch_size: int) -> tuple[float, int, int]:
    """Score ``images`` with the PyTorch model: (seconds, correct, images), decoding included.

    The same image list, reader and inference transform as :func:`tasks.score.score`; softmax
    and argmax per batch, no table written (a few hundred CSV rows cost milliseconds).
    """
    import numpy as np
    import torch

    from models.directory import load_model_directory
    from tasks.imagedir import load_rgb
    from tasks.score import list_images
    from tasks.transform import build_transform

    start = time.perf_counter()
    model, info = load_model_directory(model_dir)
    transform = build_transform(info.transform, "inference")
    refs, _ = list_images(images)
    classes = np.asarray(info.classes, dtype=object)
    correct = 0
    with torch.inference_mode():
        for first in range(0, len(refs), batch_size):
            batch = refs[first : first + batch_size]
            x = torch.stack([transform(load_rgb(ref.file)) for ref in batch])
            probs = torch.softmax(model(x), dim=1)
            labels = classes[probs.argmax(dim=1).numpy()]
            correct += sum(label == ref.category for label, ref in zip(labels, batch, strict=True))
    return time.perf_counter() - start, correct, len(refs)


def onnx_runtime(
    model_dir: Path, images: Path, dest: Path, batch_size: int, quantized: bool
) -> tuple[float, int, int]:
    """:func:`tasks.score.score` as a user calls it: (seconds, correct, images) from its table."""
    import pandas as pd

    from tasks.score import LABEL_COLUMN, score

    start = time.perf_counter()
    score(model_dir, images, dest, batch_size=batch_size, quantized=quantized)
    seconds = time.perf_counter() - start
    table = pd.read_csv(dest, dtype={"category": str, LABEL_COLUMN: str})
    return seconds, int((table["category"] == table[LABEL_COLUMN]).sum()), len(table)


def speed(args: argparse.Namespace, work: Path) -> dict[str, object]:
    """Train, export, quantize; time the three sides; print the table. Returns the figures."""
    from tasks.errors import QuantizationAccuracyError
    from tasks.export import export_onnx
    from tasks.imagedir import read_manifest
    from tasks.quantize import quantize

    began = time.perf_counter()
    train, val, quarters = make_digits(work / "digits", args.size)
    count = len(read_manifest(val).images)
    print(
        f"digits at {args.size}x{args.size} px: {len(read_manifest(train).images)} training, "
        f"{count} validation images ({time.perf_counter() - began:.0f} s)"
    )
    began = time.perf_counter()
    model_dir = train_model(work, train, val, args.size, args.epochs, args.learning_rate)
    top1 = json.loads((model_dir / "model.json").read_text())["metrics"].get("val/top1", 0.0)
    print(
        f"trained resnet18, {args.epochs} epoch(s), lr {args.learning_rate:g}: validation top-1 "
        f"{100 * top1:.2f}% "
        f"({time.perf_counter() - began:.0f} s)"
    )
    began = time.perf_counter()
    exported = export_onnx(model_dir, sample=val)
    print(
        f"exported: max abs difference {exported.max_abs_diff:.2g} "
        f"({time.perf_counter() - began:.0f} s)"
    )
    began = time.perf_counter()
    refused = None
    try:
        result = quantize(model_dir, train, val, max_top1_drop=args.max_top1_drop)
    except QuantizationAccuracyError as exc:
        refused = str(exc)
        print(f"quantize REFUSED: {exc}")
        # Still time the INT8 model: how fast is part of the answer even when it is refused.
        result = quantize(model_dir, train, val, max_top1_drop=100.0)
    print(
        f"quantized: top-1 {100 * result.fp32_top1:.2f}% fp32 -> {100 * result.int8_top1:.2f}% "
        f"int8, drop {result.top1_drop:.2f} points, same class for {100 * result.agreement:.2f}% "
        f"of the images, {result.calibration_images} calibration "
        f"images ({time.perf_counter() - began:.0f} s); "
        f"{(model_dir / 'model.onnx').stat().st_size / 1e6:.1f} MB -> "
        f"{result.path.stat().st_size / 1e6:.1f} MB"
    )

    for path in (p for p in val.rglob("*") if p.is_file()):  # into the page cache for all sides
        path.read_bytes()

    def run(side: str, images: Path) -> tuple[float, int, int]:
        if side == SIDES[0]:
            return torch_eager(model_dir, images, args.batch_size)
        dest = work / f"{side}.csv"
        return onnx_runtime(model_dir, images, dest, args.batch_size, side == SIDES[2])

    # Untimed: oneDNN builds torch's convolution kernels for each batch shape on first use.
    run(SIDES[0], quarters[0])
    # Round r: every engine scores quarter r % 4, one right after the other, so each ratio
    # compares runs seconds apart (a busy neighbour slows both sides alike). Each pass over the
    # four quarters scores every validation image once per engine.
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    rates: dict[str, list[float]] = {side: [] for side in SIDES}
    correct = dict.fromkeys(SIDES, 0)
    scored = dict.fromkeys(SIDES, 0)
    for round_ in range(args.passes * QUARTERS):
        for side in SIDES:
            took, right, images = run(side, quarters[round_ % QUARTERS])
            seconds[side].append(took)
            rates[side].append(images / took)
            correct[side] += right
            scored[side] += images
    top1s = {side: correct[side] / scored[side] for side in SIDES}
    best = {side: max(values) for side, values in rates.items()}
    ratios = {
        side: statistics.median(
            eager / took for eager, took in zip(seconds[SIDES[0]], seconds[side], strict=True)
        )
        for side in SIDES
    }
    rounds = args.passes * QUARTERS
    print(
        f"\n{count} validation images in {QUARTERS} stratified quarters, batch "
        f"{args.batch_size}, decoding and transform included; {rounds} rounds, each engine "
        "scoring one quarter per round; images/s: the best round; vs torch eager: median of "
        "the per-round ratios (best against best)\n"
    )
    print("| engine | images/s | vs torch eager | top-1 |")
    print("| --- | --- | --- | --- |")
    for side in SIDES:
        print(
            f"| {side} | {best[side]:.1f} | {ratios[side]:.2f}x "
            f"({best[side] / best[SIDES[0]]:.2f}x) | {100 * top1s[side]:.2f}% |"
        )
    print(
        "\nseconds per round: "
        + "; ".join(f"{side} " + ", ".join(f"{t:.2f}" for t in seconds[side]) for side in SIDES)
    )
    engines = inference_only(model_dir, val, args.batch_size)
    print(
        f"inference alone (one batch of {args.batch_size} decoded images, best of 3 runs): "
        + ", ".join(
            f"{side} {rate:.1f} images/s ({rate / engines[SIDES[0]]:.2f}x)"
            for side, rate in engines.items()
        )
    )
    drop = 100 * (top1s[SIDES[1]] - top1s[SIDES[2]])
    verdicts = [
        (f"ONNX Runtime fp32 >= {GOAL_FP32}x torch eager", ratios[SIDES[1]] >= GOAL_FP32),
        (f"ONNX Runtime INT8 >= {GOAL_INT8:g}x torch eager", ratios[SIDES[2]] >= GOAL_INT8),
        (f"INT8 top-1 drop <= {GOAL_DROP} points (measured {drop:.2f})", drop <= GOAL_DROP),
    ]
    print()
    for goal, met in verdicts:
        print(f"goal {goal}: {'met' if met else 'NOT MET'}")
    if refused:
        print(f"the quantize gate refused the INT8 model: {refused}")
    return {"best": best, "ratios": ratios, "top1": top1s, "refused": refused}


def inference_only(model_dir: Path, images: Path, batch_size: int) -> dict[str, float]:
    """images/s of each engine on one decoded batch, best of 3 runs after a warm-up run.

    Without decoding, the transform and the table, this is what the engines themselves add.
    """
    import numpy as np
    import torch

    from models.directory import ONNX, ONNX_INT8, load_model_directory
    from tasks.export import INPUT_NAME, OUTPUT_NAME
    from tasks.imagedir import load_rgb
    from tasks.score import inference_session, list_images
    from tasks.transform import build_transform

    model, info = load_model_directory(model_dir)
    transform = build_transform(info.transform, "inference")
    refs, _ = list_images(images)
    x = torch.stack([transform(load_rgb(ref.file)) for ref in refs[:batch_size]])
    feed = {INPUT_NAME: x.numpy()}
    sessions = [inference_session(model_dir / name) for name in (ONNX, ONNX_INT8)]
    engines = {
        SIDES[0]: lambda: model(x),
        SIDES[1]: lambda: sessions[0].run([OUTPUT_NAME], feed),
        SIDES[2]: lambda: sessions[1].run([OUTPUT_NAME], feed),
    }
    rates = {}
    with torch.inference_mode():
        for side, run in engines.items():
            run()
            times = []
            for _ in range(3):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            rates[side] = len(x) / float(np.min(times))
    return rates


def write_many(dest: Path, scans: list[Path], count: int) -> Path:
    """A plain folder of ``count`` digit images: the scans, linked again and again."""
    for i in range(count):
        target = dest / f"{i // 1000:03d}" / f"{i:06d}.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(scans[i % len(scans)], target)  # the same bytes, decoded again each time
        except OSError:
            shutil.copyfile(scans[i % len(scans)], target)
    return dest


def small_model(work: Path, size: int) -> Path:
    """resnet18 (seeded weights, 10 classes) at ``size`` px, exported and quantized.

    Only its memory is measured, so it is not trained; the INT8 gate is opened wide and both
    calibration and validation use 100 labeled digits.
    """
    import torch

    from models.directory import ModelInfo, save_model_directory
    from models.transform_spec import TransformSpec
    from models.zoo import build_model, resnet
    from tasks.convert import convert
    from tasks.export import export_onnx
    from tasks.quantize import quantize
    from tasks.sample import write_digits

    digits = work / "small-digits"
    convert(write_digits(work / "small-digits-raw", size=size, per_class=10), digits)
    spec = resnet("resnet18", pretrained=False)
    torch.manual_seed(0)
    info = ModelInfo(
        architecture=spec,
        classes=[str(i) for i in range(10)],
        transform=TransformSpec(resize_size=size, center_crop_size=size),
    )
    model = save_model_directory(work / "small-model", build_model(spec, 10), info)
    export_onnx(model, sample=digits)
    quantize(model, digits, digits, max_top1_drop=100.0)
    return model


def peak_rss_mb() -> float:
    """This process's peak resident set size, in MB.

    ``VmHWM`` is the high-water mark of this process's own memory map, which ``exec`` starts
    afresh. ``ru_maxrss`` is not: Linux carries it across ``exec``, so a child of a big parent
    (this benchmark holds a trained model) would report at least the parent's size.
    """
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def memory_child(model: str, images: str, dest: str, quantized: str) -> None:
    """In a fresh process: score, then print JSON with the peak RSS before and after (MB)."""
    from tasks.score import score

    before = peak_rss_mb()
    start = time.perf_counter()
    score(Path(model), Path(images), Path(dest), quantized=quantized == "1")
    seconds = time.perf_counter() - start
    peak = peak_rss_mb()
    print(json.dumps({"before_mb": before, "peak_mb": peak, "seconds": seconds}))


def memory(args: argparse.Namespace, work: Path) -> dict[str, float]:
    """Peak RSS of score() over each of ``args.memory_images`` images, one subprocess each.

    Returns the growth from the fewest to the most images, in MB, per model.
    """
    from tasks.sample import write_digits

    counts = sorted(set(args.memory_images))
    model = small_model(work, args.memory_size)
    scans = sorted(write_digits(work / "scans", size=args.memory_size).rglob("*.png"))
    folders = {n: write_many(work / f"images-{n}", scans, n) for n in counts}
    print(
        f"\nmemory: score() in a fresh process per row, {args.memory_size}x{args.memory_size} px "
        "digits (the 1,797 scans again and again), batch 64, CSV; peak RSS (VmHWM) of that "
        "process, and its RSS once imports were done\n"
    )
    print("| model | images | seconds | images/s | RSS after imports, MB | peak RSS, MB |")
    print("| --- | --- | --- | --- | --- | --- |")
    growth = {}
    for name, quantized in (("fp32", "0"), ("INT8", "1")):
        peaks = {}
        for count in counts:
            command = [sys.executable, str(Path(__file__).resolve()), "--memory-child"]
            command += [str(model), str(folders[count]), str(work / "memory.csv"), quantized]
            child = subprocess.run(
                command,
                check=True,
                capture_output=True,
                text=True,
            )
            figures = json.loads(child.stdout.strip().splitlines()[-1])
            peaks[count] = figures["peak_mb"]
            print(
                f"| {name} | {count:,} | {figures['seconds']:.1f} | "
                f"{count / figures['seconds']:,.0f} | {figures['before_mb']:.0f} | "
                f"{figures['peak_mb']:.0f} |"
            )
        growth[name] = peaks[counts[-1]] - peaks[counts[0]]
    print()
    for name, grew in growth.items():
        met = "met" if grew <= GOAL_MEMORY_MB else "NOT MET"
        print(
            f"goal peak RSS at {counts[-1]:,} images within {GOAL_MEMORY_MB:.0f} MB of "
            f"{counts[0]:,} ({name}): {grew:+.1f} MB, {met}"
        )
    return growth


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {len(os.sched_getaffinity(0))} usable core(s)"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_child:
        memory_child(*args.memory_child)
        return 0
    import onnxruntime
    import torch

    began = time.perf_counter()
    print(
        f"machine: {machine()}; torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"onnxruntime {onnxruntime.__version__}; load average {load()}"
    )
    with tempfile.TemporaryDirectory(prefix="imageops-bench-") as tmp:
        if "speed" in args.parts:
            speed(args, Path(tmp))
        if "memory" in args.parts and args.memory_images:
            memory(args, Path(tmp))
    print(f"\nload average {load()}; whole benchmark {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
