"""Convert to Image Directory: images/s on every core against a plain single-process PIL loop.

Usage: ``python bench/convert_speed.py [--images 2000] [--size 256] [--repeat 7]``

Writes ``--images`` real handwritten digits (scikit-learn's scans, upscaled to ``--size`` pixels)
into a temporary folder, half PNG and half JPEG, one sub-folder per digit. Then, on those same
files and in the same run, it times

- ``convert``: :func:`tasks.convert.convert` as a user runs it (default ``workers``: every core
  this process may use: this process and spawned ones; their start-up included),
- ``PIL loop``: the same work done by the simplest correct single-process loop: read the bytes,
  open and ``verify()``, open again and decode to RGB, sha256, write the copy, and
- ``convert again``: the same convert into the same folder, which finds it up to date (the
  source is read and hashed; nothing is decoded or written).

Each is run ``--repeat`` times, alternating, into a fresh folder; the table reports the fastest
run of each (the one least disturbed by anything else on the machine) and the CPU time of that
run, and the speed-up is the median of the per-run ratios (each convert against the loop run
right after it). The files are read once before timing so both sides find them in the page
cache. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# `python bench/convert_speed.py` puts bench/ on sys.path, not the project root.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Only light imports at module level: convert's spawned workers import this file again (as
# __mp_main__), and importing tasks.convert would make each of them import Prefect.
from PIL import Image  # noqa: E402

# A digit upscaled to 256 px compresses to a few KB as PNG: save JPEGs at a photo's quality.
JPEG_QUALITY = 90


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2000, help="images to convert (2000)")
    parser.add_argument("--size", type=int, default=256, help="side of each image in px (256)")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs of each (7)")
    parser.add_argument(
        "--workers", type=int, default=None, help="convert's workers (default: every core)"
    )
    args = parser.parse_args(argv)
    for name in ("images", "size", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.size < 8:
        parser.error("--size must be >= 8 (the digits are 8x8)")
    return args


def make_images(dest: Path, count: int, size: int) -> Path:
    """``count`` digit images in ``dest/<digit>/``, alternately PNG and JPEG, all different."""
    from tasks.sample import write_digits

    # 1,797 scans in all; write only as many as needed (the classes stay balanced).
    per_class = -(-count // 10) if count < 1797 else None
    digits = write_digits(dest.parent / "digits", size=size, per_class=per_class)
    scans = sorted(digits.rglob("*.png"))
    for i in range(count):
        scan = scans[i % len(scans)]
        folder = dest / scan.parent.name
        folder.mkdir(parents=True, exist_ok=True)
        # Past the first len(scans) images the same scans come back, as JPEGs of another
        # quality: every file stays distinct, so no run is a pile of duplicates.
        round_ = i // len(scans)
        if round_ == 0 and i % 2 == 0:
            shutil.copyfile(scan, folder / f"{i:06d}.png")
        else:
            with Image.open(scan) as img:
                img.save(folder / f"{i:06d}.jpg", quality=JPEG_QUALITY - round_ % 10)
    shutil.rmtree(digits)
    return dest


def pil_loop(source: Path, dest: Path) -> int:
    """The baseline: the same checks and copy as convert, one file after another."""
    count = 0
    for folder, dirnames, filenames in os.walk(source):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(folder, name)
            data = path.read_bytes()
            with Image.open(io.BytesIO(data)) as img:
                img.verify()
            with Image.open(io.BytesIO(data)) as img:
                img.load()
                img.convert("RGB")
            digest = hashlib.sha256(data).hexdigest()
            target = dest / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            count += bool(digest)
    return count


@contextmanager
def timed(into: list[tuple[float, float]]) -> Iterator[None]:
    """Append (wall seconds, CPU seconds of this process and of its finished children)."""
    before, started = os.times(), time.perf_counter()
    yield
    wall, after = time.perf_counter() - started, os.times()
    cpu = sum(after[:4]) - sum(before[:4])  # user, system, children's user, children's system
    into.append((wall, cpu))


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {len(os.sched_getaffinity(0))} usable core(s), {platform.system()}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load = os.getloadavg()[0]
    import PIL

    from tasks.convert import convert

    with tempfile.TemporaryDirectory(prefix="imageops-bench-") as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        source = make_images(work / "source", args.images, args.size)
        files = sorted(p for p in source.rglob("*") if p.is_file())
        total_bytes = sum(p.stat().st_size for p in files)
        for path in files:  # into the page cache, for both sides alike
            path.read_bytes()
        print(
            f"{len(files)} images of {args.size}x{args.size} px ({total_bytes / 1e6:.1f} MB) "
            f"written in {time.perf_counter() - started:.1f} s"
        )
        # name -> (wall seconds, CPU seconds of this process and its children) per run
        hit = "convert again, unchanged (cache hit)"
        times: dict[str, list[tuple[float, float]]] = {"convert": [], "PIL loop": [], hit: []}
        converted = looped = 0
        for run in range(args.repeat):
            out = work / f"convert-{run}"
            with timed(times["convert"]):
                converted = len(convert(source, out, workers=args.workers).images)
            with timed(times[hit]):
                again = len(convert(source, out, workers=args.workers).images)
            assert again == converted
            shutil.rmtree(out)
            out = work / f"loop-{run}"
            with timed(times["PIL loop"]):
                looped = pil_loop(source, out)
            shutil.rmtree(out)
        if converted != len(files) or looped != len(files):
            print(f"error: convert kept {converted} and the loop {looped} of {len(files)} images")
            return 1

    best = {name: min(values) for name, values in times.items()}
    print()
    print(f"machine: {machine()}; load average before: {load:.2f}")
    print(f"Python {platform.python_version()}, Pillow {PIL.__version__}")
    print(f"fastest of {args.repeat} run(s) each, {len(files)} images:")
    print()
    print("| method | seconds | images/s | CPU seconds (all processes) |")
    print("| --- | --- | --- | --- |")
    for name, (seconds, cpu) in best.items():
        print(f"| {name} | {seconds:.2f} | {len(files) / seconds:,.0f} | {cpu:.2f} |")
    # Each run pairs a convert with the loop right after it; the median of those ratios is the
    # figure that a noisy neighbour (one lucky or unlucky run) moves least.
    ratios = sorted(
        loop[0] / conv[0] for conv, loop in zip(times["convert"], times["PIL loop"], strict=True)
    )
    median = statistics.median(ratios)
    print()
    print(
        f"speed-up of convert over the PIL loop: {median:.2f}x (median of {len(ratios)} paired "
        f"runs; range {ratios[0]:.2f}x to {ratios[-1]:.2f}x; fastest vs fastest "
        f"{best['PIL loop'][0] / best['convert'][0]:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
