"""Fixed costs: what `imageops --help`, `evaluate`, `score` and `export` cost before any data.

Usage: ``python -m bench.fixed_costs [--full] [--json PATH]``

Each command runs as a user runs it (``app.cli.main``, what the ``imageops`` script calls), in
a fresh process, in a project of its own (``IMAGEOPS_HOME`` under the scratch folder).
``--help`` and ``evaluate`` of a small scored CSV (the digits' 30 images, scored by an untrained
resnet18 at 32 px) are timed until they exit; ``evaluate`` writes its files beside the table and,
as it does unless given ``--run-id`` or ``--new-run``, nothing to MLflow. ``score`` and ``export``
are timed until they open their first image: the process starts under an audit hook that ends it
at the first ``open`` of an image below the input folder, so the figure is the start-up (imports,
model and ONNX Runtime session) and nothing of the work on the data. Each process's CPU seconds
come from ``wait4``, its peak RSS (``VmHWM``) from the process itself as it ends. Goals (issue
26, point 4): evaluate under 2 s, ``--help`` under 1 s, score and export at their first image
within 3 s. Quick: 3 runs each; ``--full``: 7.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # `python bench/fixed_costs.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import ROOT, Section, Stat, Table, run_main

SIZE = 32  # px: the smallest input resnet18 takes
GOALS = {"--help": 1.0, "evaluate": 2.0, "score": 3.0, "export": 3.0}  # seconds
MARK = "FIXED-COSTS"
# ``python -c PROBE FOLDER ARGS...`` is ``imageops ARGS...`` that prints, as it ends, the time
# (time.time(): comparable across processes on one machine) and its own peak RSS (VmHWM: the
# parent's rusage would report at least the parent's size, which Linux carries across exec).
# With a FOLDER, it ends (os._exit) at the first image it opens below it.
PROBE = f"""
import atexit, os, sys, time
folder = os.path.realpath(sys.argv[1]) + os.sep if sys.argv[1] else None
suffixes = (".png", ".jpg", ".jpeg")
def report(kind):
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    os.write(1, f"\\n{MARK} {{kind}} {{time.time()!r}} {{peak}}\\n".encode())
def first_image(event, args):
    if folder and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.realpath(os.fsdecode(args[0]))
        if path.startswith(folder) and path.lower().endswith(suffixes):
            report("image")
            os._exit(0)
sys.addaudithook(first_image)
atexit.register(report, "exit")
sys.argv = ["imageops", *sys.argv[2:]]
from app.cli import main
main()
"""


@dataclass(frozen=True)
class Run:
    seconds: float  # wall, from just before the process was started to its exit or first image
    cpu: float  # user + system seconds of the process
    peak_mb: float


def project_env(home: Path) -> dict[str, str]:
    """This environment pointed at a project of the benchmark's own, nothing shared."""
    prefixes = ("IMAGEOPS_", "PREFECT_", "MLFLOW_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    return env | {
        "PYTHONPATH": str(ROOT),
        "IMAGEOPS_HOME": str(home),
        "IMAGEOPS_PROJECT_ROOT": str(home.parent),
    }


def timed(
    args: list[str], env: dict[str, str], logs: Path, *, until_image: Path | None = None
) -> Run:
    """One fresh ``imageops ARGS`` (the probe), to its exit or to its first image below
    ``until_image``: wall time, its CPU time (``wait4``) and its peak RSS (its own report)."""
    folder = "" if until_image is None else str(until_image)
    command = [sys.executable, "-c", PROBE, folder, *args]
    out, err = logs.with_suffix(".out"), logs.with_suffix(".err")
    with out.open("wb") as stdout, err.open("wb") as stderr:
        start = time.time()
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=stdout, stderr=stderr)
        _, status, usage = os.wait4(proc.pid, 0)
        end = time.time()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, for its rusage
    if proc.returncode != 0:
        tail = err.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{' '.join(args)} failed ({proc.returncode}):\n{tail}")
    marks = [line.split() for line in out.read_text().splitlines() if line.startswith(MARK)]
    if not marks:
        raise SystemExit(f"{' '.join(args)} ended without reporting (no {MARK} line)")
    kind, when, peak_kb = marks[-1][1:]
    if until_image is not None:
        if kind != "image":
            raise SystemExit(f"{' '.join(args)} ended without opening an image in {until_image}")
        end = float(when)
    return Run(end - start, usage.ru_utime + usage.ru_stime, int(peak_kb) / 1024)


def prepare(work: Path) -> tuple[Path, Path, Path]:
    """(images, model, scored CSV): 30 digits as an ImageDirectory, an exported untrained
    resnet18, and the images scored by it."""
    from bench.score_speed import untrained_model
    from tasks.data.convert import convert
    from tasks.data.sample import write_digits
    from tasks.inference.export import export_onnx
    from tasks.inference.score import score

    raw = write_digits(work / "raw", size=SIZE, per_class=3)
    images = work / "images"
    convert(raw, images)
    shutil.rmtree(raw)
    model = untrained_model(work / "model", SIZE)
    export_onnx(model, sample=images)
    return images, model, score(model, images, work / "scored.csv")


def run(full: bool, work: Path) -> Section:
    repeats = 7 if full else 3
    images, model, scored = prepare(work)
    env = project_env(work / "project" / ".imageops")
    commands = {
        "--help": (["--help"], None),
        "evaluate": (["evaluate", str(scored)], None),
        "score": (["score", str(model), str(images), str(work / "out.csv")], images),
        "export": (["export", str(model), "--sample", str(images)], images),
    }
    logs = work / "logs"
    logs.mkdir()
    runs: dict[str, list[Run]] = {name: [] for name in commands}
    for i in range(repeats):  # interleaved, so a busy spell touches every command
        for name, (args, until_image) in commands.items():
            log = logs / f"{name.strip('-')}-{i}"
            runs[name].append(timed(args, env, log, until_image=until_image))
    rows = []
    met = {}
    for name, done in runs.items():
        wall = Stat([r.seconds for r in done], "s")
        met[name] = wall.median < GOALS[name]
        what = "to exit" if commands[name][1] is None else "to the first image"
        rows.append(
            [
                f"`imageops {name}`" + ("" if name == "--help" else " " + what),
                wall,
                Stat([r.cpu for r in done], "s"),
                Stat([r.peak_mb for r in done], "MB"),
                f"under {GOALS[name]:g} s: {'met' if met[name] else 'not met'}",
            ]
        )
    rows_scored = len(scored.read_text().splitlines()) - 1
    return Section(
        key="fixed_costs",
        title="Fixed costs: start-up of the command line",
        command=f"python -m bench.fixed_costs{' --full' if full else ''}",
        text=[
            f"Each command in a fresh process, {repeats} runs each, interleaved; evaluate reads "
            f"a scored CSV of {rows_scored} rows and writes its files (no MLflow run: "
            "`--run-id` or `--new-run` asks for one); score and export "
            "are stopped at the first image they open (an untrained resnet18 at 32 px, exported "
            "to ONNX). CPU time and peak RSS are the process's own, up to that point."
        ],
        tables=[Table(["command", "wall time", "CPU time", "peak RSS", "goal (issue 26)"], rows)],
        figures={
            f"fixed_costs/{name}": Stat([r.seconds for r in done], "s")
            for name, done in runs.items()
        },
    )


if __name__ == "__main__":
    sys.exit(run_main(run, __doc__.split("\n\n")[0]))
