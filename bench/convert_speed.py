"""Convert to Image Directory: images/s on every core against a plain PIL loop, and its scaling.

Usage: ``python -m bench.convert_speed [--full] [--json PATH]``

Writes real handwritten digits (scikit-learn's 1,797 scans, upscaled: 64 px in the quick run,
256 px with ``--full``) into a temporary folder, half PNG and half JPEG, one sub-folder per digit.
Past 1,797 the scans come back in the other format, and every file carries its number in a
comment, so no two files are identical and each decodes like its scan. Then, on the same files,
it times

- ``convert``: :func:`tasks.data.convert.convert` as a user runs it (default ``workers``: every core
  this process may use, once the input is big enough to gain from them; the workers' start-up is
  timed too),
- ``PIL loop``: the same work done by the simplest correct single-process loop: read the bytes,
  open and ``verify()``, open again and decode to RGB, sha256, write the copy, and
- ``convert again``: the same convert into the same folder, which finds it up to date (the
  source is read and hashed; nothing is decoded or written).

It does so in rounds: in each, convert and the loop run one right after the other (which goes
first alternates), each into a fresh folder, and the speed-up is the ratio of that round's two
times, so a busy neighbour slows both sides alike. The main comparison also times the cache hit
(10,000 images in the quick run, where only that many are big enough for convert to start its
workers; 2,000 with ``--full``); the scaling curve times convert and the loop at 1,000 and 10,000
images (``docs/img/bench-convert.png``). The files are read once before timing, so both sides find
them in the page cache. Quick: 64 px, 3 rounds (about a minute on 2 quiet cores); ``--full``:
256 px, 5 rounds (several minutes).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import shutil
import struct
import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # `python bench/convert_speed.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Only light imports at module level: convert's spawned workers import this file again (as
# __mp_main__), and importing tasks.data.convert here would make each of them import Prefect.
from bench.report import Plot, Section, Series, Stat, Table, run_main, usable_cores

# A digit upscaled to 256 px compresses to a few KB as PNG: save JPEGs at a photo's quality.
JPEG_QUALITY = 90
CONVERT, HIT, LOOP, SPLIT = "convert", "convert again", "PIL loop", "split"
SPLIT_GOAL_MS = 0.1  # per image: split is metadata plus links (issue 26, point 3)


@dataclass(frozen=True)
class Sizes:
    """What one mode measures."""

    px: int  # side of each image
    main: int  # images in the main comparison, the one that also times the cache hit
    scaling: tuple[int, ...]  # images at each point of the scaling curve
    rounds: int  # paired runs at each number of images


# Quick: small images, so 10,000 of them take seconds; that point is also the main comparison
# (the only one big enough for convert to start its workers at 64 px).
QUICK = Sizes(px=64, main=10_000, scaling=(1_000, 10_000), rounds=3)
FULL = Sizes(px=256, main=2_000, scaling=(1_000, 10_000), rounds=5)


@dataclass(frozen=True)
class Timing:
    """One timed run."""

    wall: float  # seconds
    cpu: float  # CPU seconds of this process and its finished children (convert's workers)
    children: float  # CPU seconds of the children alone: > 0 when convert started workers


@contextmanager
def timed(into: list[Timing]) -> Iterator[None]:
    """Append the wall and CPU time of the block; children count once they have exited."""
    before, started = os.times(), time.perf_counter()
    yield
    wall, after = time.perf_counter() - started, os.times()
    children = after.children_user + after.children_system
    children -= before.children_user + before.children_system
    own = after.user + after.system - before.user - before.system
    into.append(Timing(wall, own + children, children))


def _png_with_comment(data: bytes, text: str) -> bytes:
    """``data`` (a PNG) with a tEXt chunk just before its IEND chunk (the last 12 bytes)."""
    assert data[-8:-4] == b"IEND", "not a PNG ending in IEND"
    body = b"tEXt" + b"Comment\0" + text.encode()
    chunk = struct.pack(">I", len(body) - 4) + body + struct.pack(">I", zlib.crc32(body))
    return data[:-12] + chunk + data[-12:]


def _jpeg_with_comment(data: bytes, text: str) -> bytes:
    """``data`` (a JPEG) with a COM segment after the JFIF header (or right after SOI)."""
    at = 4 + int.from_bytes(data[4:6], "big") if data[2:4] == b"\xff\xe0" else 2
    body = text.encode()
    return data[:at] + b"\xff\xfe" + struct.pack(">H", len(body) + 2) + body + data[at:]


def make_images(work: Path, counts: Sequence[int], px: int) -> dict[int, Path]:
    """A folder of ``n`` digit images for each ``n`` in ``counts``, one sub-folder per digit.

    Only the scans are encoded (each as a PNG and a JPEG); file ``i`` is a comment spliced into
    the bytes of scan ``i`` modulo 1,797, so writing 10,000 costs little more than copying them.
    The digits take turns, so the first ``n`` files of the largest folder are a balanced set with
    the same PNG/JPEG mix: the smaller folders are hard links to them.
    """
    from PIL import Image

    from tasks.data.sample import write_digits

    scans = write_digits(work / "scans", size=px)
    by_digit = [sorted(folder.glob("*.png")) for folder in sorted(scans.iterdir())]
    encoded: list[tuple[str, bytes, bytes, bool]] = []  # (digit, PNG, JPEG, PNG first)
    for row, paths in enumerate(itertools.zip_longest(*by_digit)):
        for digit, path in enumerate(paths):
            if path is None:  # this digit has fewer scans
                continue
            buffer = io.BytesIO()
            with Image.open(path) as img:
                img.save(buffer, format="JPEG", quality=JPEG_QUALITY)
            png_first = (row + digit) % 2 == 0  # half of each digit, half of each row
            encoded.append((path.parent.name, path.read_bytes(), buffer.getvalue(), png_first))
    shutil.rmtree(scans)

    largest = max(counts)
    folders = {n: work / f"images-{n}" for n in counts}
    names: list[str] = []
    for i in range(largest):
        digit, png, jpeg, png_first = encoded[i % len(encoded)]
        comment = f"imageops benchmark image {i}"
        if png_first == (i // len(encoded) % 2 == 0):  # the other format on the next pass
            name, data = f"{digit}/{i:06d}.png", _png_with_comment(png, comment)
        else:
            name, data = f"{digit}/{i:06d}.jpg", _jpeg_with_comment(jpeg, comment)
        path = folders[largest] / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        names.append(name)
    for n, folder in folders.items():
        for name in names[:n] if n != largest else ():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            os.link(folders[largest] / name, folder / name)
    return folders


def pil_loop(source: Path, dest: Path) -> int:
    """The baseline: the same checks and copy as convert, one file after another."""
    from PIL import Image

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


def measure(
    source: Path, work: Path, count: int, rounds: int, hit: bool
) -> dict[str, list[Timing]]:
    """``rounds`` paired runs of convert (with ``hit``: convert again, then split) and the loop."""
    from tasks.data.convert import convert
    from tasks.data.split import split

    times: dict[str, list[Timing]] = {CONVERT: [], LOOP: []}
    times |= {HIT: [], SPLIT: []} if hit else {}

    def run_convert(round_: int) -> None:
        out = work / f"convert-{round_}"
        with timed(times[CONVERT]):
            converted = len(convert(source, out).images)
        if hit:
            with timed(times[HIT]):
                again = len(convert(source, out).images)
            if again != converted:
                raise SystemExit(f"error: convert found {converted} images, then {again}")
            with timed(times[SPLIT]):
                split(out, work / "split-a", work / "split-b", fraction=0.9, seed=round_)
            for half in ("split-a", "split-b"):
                shutil.rmtree(work / half)
        shutil.rmtree(out)
        if converted != count:
            raise SystemExit(f"error: convert kept {converted} of {count} images")

    def run_loop(round_: int) -> None:
        out = work / f"loop-{round_}"
        with timed(times[LOOP]):
            looped = pil_loop(source, out)
        shutil.rmtree(out)
        if looped != count:
            raise SystemExit(f"error: the PIL loop kept {looped} of {count} images")

    for round_ in range(rounds):
        # Alternate which goes first, so neither always follows the other's writes.
        first, second = (run_convert, run_loop) if round_ % 2 == 0 else (run_loop, run_convert)
        first(round_)
        second(round_)
    return times


def ratio(baseline: list[Timing], other: list[Timing]) -> Stat:
    """How many times faster ``other`` ran than ``baseline``, round by round."""
    return Stat([b.wall / o.wall for b, o in zip(baseline, other, strict=True)], "x")


def per_second(count: int, runs: list[Timing]) -> Stat:
    return Stat([count / t.wall for t in runs], "images/s")


def processes(runs: list[Timing]) -> str:
    """How many processes convert checked the images in (workers leave CPU time behind)."""
    return f"{usable_cores()} processes" if any(t.children > 0 for t in runs) else "1 process"


def run(full: bool, work: Path) -> Section:
    """Time convert, its cache hit and the PIL loop on the main set, then at each scaling size."""
    from tasks.data.convert import MIN_BYTES_FOR_POOL, MIN_FILES_FOR_POOL

    sizes = FULL if full else QUICK
    counts = sorted({sizes.main, *sizes.scaling})
    started = time.perf_counter()
    folders = make_images(work, counts, sizes.px)
    largest = folders[max(counts)]
    files = [path for path in largest.rglob("*") if path.is_file()]
    megabytes = sum(len(path.read_bytes()) for path in files) / 1e6  # now in the page cache
    print(
        f"{len(files):,} images of {sizes.px}x{sizes.px} px ({megabytes:.1f} MB) written in "
        f"{time.perf_counter() - started:.1f} s",
        flush=True,
    )
    results: dict[int, dict[str, list[Timing]]] = {}
    for n in counts:
        began = time.perf_counter()
        results[n] = measure(folders[n], work, n, sizes.rounds, hit=n == sizes.main)
        print(f"{n:,} images: {sizes.rounds} rounds in {time.perf_counter() - began:.0f} s")

    main = results[sizes.main]
    main_table = Table(
        ["method", "seconds", "images/s", "CPU seconds (all processes)", "vs the PIL loop"],
        [
            [
                f"`convert` ({processes(main[CONVERT])})",
                Stat([t.wall for t in main[CONVERT]], "s"),
                per_second(sizes.main, main[CONVERT]),
                Stat([t.cpu for t in main[CONVERT]], "s"),
                ratio(main[LOOP], main[CONVERT]),
            ],
            [
                "`convert` again, unchanged (cache hit)",
                Stat([t.wall for t in main[HIT]], "s"),
                per_second(sizes.main, main[HIT]),
                Stat([t.cpu for t in main[HIT]], "s"),
                ratio(main[LOOP], main[HIT]),
            ],
            [
                "`split` of convert's output, 90/10 (links)",
                Stat([t.wall for t in main[SPLIT]], "s"),
                per_second(sizes.main, main[SPLIT]),
                Stat([t.cpu for t in main[SPLIT]], "s"),
                "",
            ],
            [
                "PIL loop (1 process)",
                Stat([t.wall for t in main[LOOP]], "s"),
                per_second(sizes.main, main[LOOP]),
                Stat([t.cpu for t in main[LOOP]], "s"),
                "1.00x",
            ],
        ],
        title=f"{sizes.main:,} images of {sizes.px}x{sizes.px} px",
    )
    scaling_table = Table(
        ["images", "`convert` images/s", "PIL loop images/s", "speed-up", "`convert` ran in"],
        [
            [
                n,
                per_second(n, results[n][CONVERT]),
                per_second(n, results[n][LOOP]),
                ratio(results[n][LOOP], results[n][CONVERT]),
                processes(results[n][CONVERT]),
            ]
            for n in sizes.scaling
        ],
        title=f"Scaling, {sizes.px}x{sizes.px} px",
    )
    xs = [float(n) for n in sizes.scaling]
    plot = Plot(
        file="bench-convert.png",
        title=f"Convert to Image Directory, {sizes.px}x{sizes.px} px images",
        x_label="images",
        panels=[
            (
                "images/s",
                [
                    Series(
                        "convert", xs, [per_second(n, results[n][CONVERT]) for n in sizes.scaling]
                    ),
                    Series(
                        "PIL loop", xs, [per_second(n, results[n][LOOP]) for n in sizes.scaling]
                    ),
                ],
            )
        ],
    )
    split_ms = Stat([t.wall / sizes.main * 1000 for t in main[SPLIT]], "ms")
    split_met = "met" if split_ms.median <= SPLIT_GOAL_MS else "NOT MET"
    shared = (
        f" The main table is the {sizes.main:,}-image point of the scaling table: the same runs."
        if sizes.main in sizes.scaling
        else ""
    )
    return Section(
        key="convert",
        title="Convert to Image Directory: every core vs a plain PIL loop, and scaling",
        command=f"python -m bench.convert_speed{' --full' if full else ''}",
        text=[
            f"Scikit-learn's 1,797 handwritten digit scans upscaled to {sizes.px}x{sizes.px} px, "
            f"half PNG and half JPEG (quality {JPEG_QUALITY}), one folder per digit; past 1,797 "
            "the scans come back in the other format, each file with its number in a comment, so "
            f"no two are identical ({len(files):,} files, {megabytes:.1f} MB, read once "
            f"beforehand so every run finds them in the page cache). {sizes.rounds} rounds per "
            "number of images; in each, `convert` and the PIL loop run one right after the "
            "other (which goes first alternates) into fresh folders, and the speed-up is the "
            f"loop's time over convert's in that round.{shared}",
            "`convert` is `tasks.data.convert.convert` as a user calls it: it checks images "
            f"on every core this process may use ({usable_cores()} here: itself and spawned "
            f"workers, whose start-up is timed) once the input has at least "
            f"{MIN_FILES_FOR_POOL} files and {MIN_BYTES_FOR_POOL / 1024**2:.0f} MiB, and in this "
            "process alone below that, "
            "where starting workers would cost more than it saves. The PIL loop does the same "
            "work one file after another: read, `verify()`, decode to RGB, sha256, write the "
            "copy. The cache hit is `convert` run again into its own output: it reads and "
            "hashes the source, finds it unchanged and writes nothing. CPU seconds count this "
            "process and convert's workers. `split` splits the converted folder 90/10 with "
            "hard links (each image checked against its sha256 first), in the cache-hit round; "
            f"**goal: at most {SPLIT_GOAL_MS} ms per image: {split_met}** ({split_ms.format()}). "
            + (
                "Full run: 256 px images, 2,000 in the main table, 5 rounds."
                if full
                else "Quick run (`--full`: 256 px images, 2,000 in the main table, 5 rounds)."
            ),
        ],
        tables=[main_table, scaling_table],
        plots=[plot],
    )


if __name__ == "__main__":
    sys.exit(run_main(run, __doc__.split("\n\n")[0]))
