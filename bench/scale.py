"""Data at scale: time, CPU, peak memory and disk of each data step as the images grow.

Usage: ``python -m bench.scale [--full] [--json PATH]``

At each size (quick: 1,000, 10,000 and 50,000 images; ``--full``: 1,000, 10,000, 100,000 and
200,000, the size issue 26 sets memory's goal at)
the digits are written as 64 px images (half PNG, half JPEG, every file different:
:func:`bench.convert_speed.make_images`), and a fresh project runs the data steps as a user
types them, each ``imageops`` command in a process of its own:

``convert`` the folder, ``split`` it 90/10, ``version`` it (DVC add and push; the project's DVC
repository is made first, untimed, by versioning a one-image folder), ``transform apply`` in
inference mode to the validation split, ``score`` every image with an untrained resnet18 at 32 px
(ONNX Runtime), ``evaluate`` the scores and ``promote`` that model (registered, untimed, as the
challenger) with every image as the holdout. Right after ``version``, plain ``dvc add`` and
``dvc push`` of a copy of the converted folder, in a DVC repository of their own with the same
cache link types (its baseline); right after ``convert`` at the largest size, the PIL loop that
does convert's work in one process (:func:`bench.convert_speed.pil_loop`, its baseline).

Each command's CPU seconds and peak RSS are those of the command and every process it waited
for, read by a small wrapper process (a child started by a big parent would carry the parent's
peak). Disk is counted per inode (a hard link once) over the source, the project (working copy,
DVC cache) and the DVC remote, after the version step, and again without the remote (the case
of a remote elsewhere, such as S3). Growth exponents are the slope of
log(wall time) between the smallest and the largest size (1.0: linear). Goals: issue 26.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # `python bench/scale.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.convert_speed import make_images, pil_loop
from bench.fixed_costs import project_env
from bench.report import ROOT, Section, Stat, Table, run_main

QUICK = (1_000, 10_000, 50_000)
FULL = (1_000, 10_000, 100_000, 200_000)
MID = 10_000  # memory's goal compares the largest size with this one
PX = 64  # images on disk
INPUT = 32  # the model's input
STEPS = ("convert", "split", "version", "transform apply", "score", "evaluate", "promote")
MEMORY_FLAT_MB = 100  # issue 26, point 2: peak RSS at the largest size within this of 10,000
VERSION_CPU_GOAL = 1.1  # imageops version / (dvc add + dvc push), CPU seconds
CONVERT_GOAL = 1.5  # convert / PIL loop speed at the largest size
SPLIT_GOAL_MS = 0.1
DISK_GOAL = 3.2  # source + project + remote, over the source
DISK_GOAL_REMOTE_ELSEWHERE = 2.2  # the same without the remote (on S3, another machine)
# ``python -c MEASURE REPORT ARGV...``: runs ARGV and writes the CPU seconds and the peak RSS
# (KiB) of everything it waited for.
MEASURE = """
import resource, subprocess, sys
code = subprocess.call(sys.argv[2:])
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
with open(sys.argv[1], "w") as fh:
    fh.write(f"{usage.ru_utime + usage.ru_stime} {usage.ru_maxrss}")
sys.exit(code)
"""


@dataclass(frozen=True)
class Run:
    wall: float  # seconds
    cpu: float  # seconds, the command and its waited-for descendants
    peak_mb: float


def measured(argv: list[str], cwd: Path, env: dict[str, str], log: Path) -> Run:
    """Run ``argv`` under the measuring wrapper; exit on failure with the end of its output."""
    report = log.with_suffix(".usage")
    with log.open("wb") as out:
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", MEASURE, str(report), *argv],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        wall = time.perf_counter() - started
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{tail}")
    cpu, peak_kib = report.read_text().split()
    return Run(wall, float(cpu), int(peak_kib) / 1024)


@dataclass(frozen=True)
class Disk:
    """Disk after version over the source's: blocks (as ``du``) and the files' own bytes, with
    the DVC remote and without it."""

    blocks: float
    files: float
    blocks_no_remote: float
    files_no_remote: float


def disk_after_version(source: Path, project: Path, remote: Path) -> Disk:
    """:class:`Disk` of ``source`` and ``project``, whose home holds the DVC remote (a copy of
    each image, linked to nothing else, so leaving it out is a subtraction)."""
    ratios = []
    for files_only in (False, True):
        whole = disk_bytes(source, project, files_only=files_only)
        ratios.append((whole, whole - disk_bytes(remote, files_only=files_only)))
    blocks = disk_bytes(source)
    files = disk_bytes(source, files_only=True)
    return Disk(ratios[0][0] / blocks, ratios[1][0] / files, ratios[0][1] / blocks,
                ratios[1][1] / files)  # fmt: skip


def disk_bytes(*folders: Path, files_only: bool = False) -> int:
    """Bytes on disk under ``folders``, each inode once (a hard link is not a copy): blocks of
    files and folders, as ``du`` counts them; with ``files_only``, the files' own sizes (no
    folder blocks: what copies of the images weigh, without the stores' layout)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for folder in folders:
        for dirpath, _, filenames in os.walk(folder):
            for name in [".", *filenames]:
                st = os.lstat(os.path.join(dirpath, name))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    if not files_only:
                        total += st.st_blocks * 512
                    elif name != ".":
                        total += st.st_size
    return total


def prepare_model(work: Path) -> Path:
    """An untrained resnet18 at 32 px, exported to ONNX, made in a process of its own (this one
    stays small: the commands it starts would carry its peak memory)."""
    model = work / "model"
    code = (
        "import sys; from pathlib import Path\n"
        "from bench.score_speed import untrained_model\n"
        "from tasks.inference.export import export_onnx\n"
        f"export_onnx(untrained_model(Path(sys.argv[1]), {INPUT}))\n"
    )
    subprocess.run([sys.executable, "-c", code, str(model)], cwd=ROOT, check=True)
    return model


def imageops_steps(
    n: int, source: Path, model: Path, work: Path, with_loop: bool
) -> tuple[dict[str, Run], Disk]:
    """Every step at ``n`` images in a fresh project; the runs, and the disk after version.

    Each baseline runs right after the step it is compared with, so a busy spell of this shared
    machine touches both: ``dvc add`` + ``dvc push`` after ``version`` (as ``"dvc"``), and with
    ``with_loop`` the PIL loop after ``convert`` (as ``"PIL loop"``).
    """
    project = work / f"project-{n}"
    (project / "data").mkdir(parents=True)
    env, logs = project_env(project / ".imageops"), work / f"logs-{n}"
    logs.mkdir()
    cli = [sys.executable, "-m", "app.cli"]
    warm = project / "data" / "warm-up" / "0"  # one image, to make the DVC repository
    warm.mkdir(parents=True)
    first = min((source / "0").iterdir())
    os.link(first, warm / first.name)
    warm = warm.parent
    measured([*cli, "convert", str(warm), str(project / "data" / "warm-img")], project, env,
             logs / "warm-convert.log")  # fmt: skip
    measured([*cli, "version", "data/warm-img"], project, env, logs / "warm-version.log")
    measured([*cli, "transform", "init", "transform", "--resize-size", str(INPUT),
              "--center-crop-size", str(INPUT), "--no-random-horizontal-flip"],
             project, env, logs / "transform-init.log")  # fmt: skip
    commands = {
        "convert": ["convert", str(source), "data/images"],
        "split": ["split", "data/images", "data/train", "data/val", "--fraction", "0.9",
                  "--seed", "1"],
        "version": ["version", "data/images"],
        "transform apply": ["transform", "apply", "transform", "data/val", "data/val32",
                            "--mode", "inference"],
        "score": ["score", str(model), "data/images", "scored.csv"],
        "evaluate": ["evaluate", "scored.csv"],
        "promote": ["promote", "data/images"],
    }  # fmt: skip
    runs: dict[str, Run] = {}
    disk = Disk(0.0, 0.0, 0.0, 0.0)
    for step in STEPS:
        if step == "promote":  # the model to promote, as the challenger
            measured([*cli, "register", str(model), "--alias", "challenger"], project, env,
                     logs / "register.log")  # fmt: skip
        runs[step] = measured([*cli, *commands[step]], project, env, logs / f"{step}.log")
        if step == "version":
            remote = project / ".imageops" / "dvc-remote"  # the default: under the home
            if not remote.is_dir():
                raise SystemExit(f"no DVC remote at {remote} after version")
            disk = disk_after_version(source, project, remote)
            runs["dvc"] = plain_dvc(n, work)
        if step == "convert" and with_loop:
            runs["PIL loop"] = pil_loop_run(source, work)
        print(f"{n:>7,} images  {step:<16} {runs[step].wall:7.1f} s", flush=True)
    return runs, disk


def plain_dvc(n: int, work: Path) -> Run:
    """``dvc add`` and ``dvc push`` of the converted folder, in a DVC repository of their own."""
    from tasks.data.dvc_cache import CACHE_TYPE

    project, logs = work / f"dvc-{n}", work / f"logs-{n}"
    shutil.copytree(work / f"project-{n}" / "data" / "images", project / "images",
                    copy_function=shutil.copy2)  # fmt: skip
    env = project_env(project / ".imageops")
    dvc = [sys.executable, "-m", "dvc"]
    for args in (["init", "--no-scm"], ["config", "cache.type", CACHE_TYPE],
                 ["remote", "add", "-d", "local", str(work / f"dvc-remote-{n}")]):  # fmt: skip
        subprocess.run([*dvc, *args], cwd=project, env=env, check=True, capture_output=True)
    add = measured([*dvc, "add", "images"], project, env, logs / "dvc-add.log")
    push = measured([*dvc, "push"], project, env, logs / "dvc-push.log")
    shutil.rmtree(project)
    return Run(add.wall + push.wall, add.cpu + push.cpu, max(add.peak_mb, push.peak_mb))


def pil_loop_run(source: Path, work: Path) -> Run:
    """The PIL loop over ``source``, in this process (a small one: nothing heavy imported)."""
    before, started = os.times(), time.perf_counter()
    pil_loop(source, work / "pil-loop")
    wall, after = time.perf_counter() - started, os.times()
    shutil.rmtree(work / "pil-loop")
    return Run(wall, after.user + after.system - before.user - before.system, 0.0)


def exponent(sizes: tuple[int, ...], values: list[float]) -> float:
    """Slope of log(value) against log(size) from the smallest size to the largest."""
    return math.log(values[-1] / values[0]) / math.log(sizes[-1] / sizes[0])


def run(full: bool, work: Path) -> Section:
    sizes = FULL if full else QUICK
    sources = make_images(work, sizes, PX)
    model = prepare_model(work)
    runs: dict[int, dict[str, Run]] = {}
    disk: dict[int, Disk] = {}
    largest = sizes[-1]
    for n in sizes:
        runs[n], after_version = imageops_steps(n, sources[n], model, work, n == largest)
        disk[n] = after_version
    baseline = {n: runs[n]["dvc"] for n in sizes}
    loop = runs[largest]["PIL loop"]

    def cell(r: Run) -> str:
        return f"{r.wall:.1f} s, {r.cpu:.1f} CPU s, {r.peak_mb:,.0f} MB"

    rows = [
        [f"`imageops {step}`", *(cell(runs[n][step]) for n in sizes),
         f"{exponent(sizes, [runs[n][step].wall for n in sizes]):.2f}"]
        for step in STEPS
    ]  # fmt: skip
    rows.append(
        ["`dvc add` + `dvc push` (baseline)", *(cell(baseline[n]) for n in sizes),
         f"{exponent(sizes, [baseline[n].wall for n in sizes]):.2f}"]
    )  # fmt: skip
    columns = ["step", *(f"{n:,} images" for n in sizes), "growth exponent (time)"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "not met"

    mid = MID
    flat = {s: runs[largest][s].peak_mb - runs[mid][s].peak_mb for s in STEPS}
    version_ratio = {n: runs[n]["version"].cpu / baseline[n].cpu for n in sizes}
    convert_speedup = loop.wall / runs[largest]["convert"].wall
    split_ms = runs[largest]["split"].wall / largest * 1000
    goals = [
        [f"peak RSS of `{s}` at {largest:,} minus at {mid:,}", f"<= {MEMORY_FLAT_MB} MB",
         f"{flat[s]:+,.0f} MB", verdict(flat[s] <= MEMORY_FLAT_MB)]
        for s in STEPS
    ]  # fmt: skip
    goals += [
        [f"`imageops version` CPU / `dvc add` + `dvc push` CPU at {n:,}",
         f"<= {VERSION_CPU_GOAL}x", f"{version_ratio[n]:.2f}x",
         verdict(version_ratio[n] <= VERSION_CPU_GOAL)]
        for n in sizes
    ]  # fmt: skip
    goals += [
        [f"convert / PIL loop speed at {largest:,} (wall; loop {loop.wall:.1f} s)",
         f">= {CONVERT_GOAL}x", f"{convert_speedup:.2f}x",
         verdict(convert_speedup >= CONVERT_GOAL)],
        [f"split per image at {largest:,} (the whole command)", f"<= {SPLIT_GOAL_MS} ms",
         f"{split_ms:.3f} ms", verdict(split_ms <= SPLIT_GOAL_MS)],
    ]  # fmt: skip
    goals += [
        [f"disk after version at {n:,} (source, working copy, DVC cache and remote) / source: "
         "blocks, as `du`; the files' own bytes", f"<= {DISK_GOAL}x",
         f"{disk[n].blocks:.2f}x; {disk[n].files:.2f}x", verdict(disk[n].blocks <= DISK_GOAL)]
        for n in sizes
    ]  # fmt: skip
    goals += [
        [f"disk after version at {n:,} without the remote (a remote elsewhere, e.g. S3) / "
         "source: blocks; bytes", f"<= {DISK_GOAL_REMOTE_ELSEWHERE}x",
         f"{disk[n].blocks_no_remote:.2f}x; {disk[n].files_no_remote:.2f}x",
         verdict(disk[n].blocks_no_remote <= DISK_GOAL_REMOTE_ELSEWHERE)]
        for n in sizes
    ]  # fmt: skip
    return Section(
        key="scale",
        title="Data at scale: each data step at 1k to 50k images (to 200k with --full)",
        command=f"python -m bench.scale{' --full' if full else ''}",
        text=[
            f"Digits as {PX} px images, half PNG and half JPEG; one run of each command per "
            f"size, each in a fresh process, in a fresh project per size. Each cell: wall time, "
            "CPU seconds and peak RSS of the command with the processes it waited for. "
            "`transform apply` works on the validation split (a tenth of the images); `score` "
            "scores them all, and `promote` scores them again as its holdout (the untrained "
            "model, registered first, untimed). Split's per-image figure includes the command's "
            "start-up, so its own goal is also measured without it in the convert section. "
            "Disk counts the source, the project (working copy, DVC cache) and the DVC remote "
            "(then without the remote: a remote elsewhere, such as S3), each inode once, "
            "in blocks as `du` does, and as the files' own bytes: a DVC store keeps its objects "
            "in up to 256 prefix folders, 1 MB of folder blocks in the cache and again in the "
            "remote whatever the data's size, half the size of 1,000 small images."
        ],
        tables=[
            Table(columns, rows),
            Table(["goal (issue 26)", "wanted", "measured", ""], goals, "Goals"),
        ],
        figures={
            f"scale/{step}/{n}": Stat([runs[n][step].wall], "s") for step in STEPS for n in sizes
        },
    )


if __name__ == "__main__":
    sys.exit(run_main(run, __doc__.split("\n\n")[0]))
