"""End to end: the pipeline flow vs the same steps as plain calls; what orchestration costs.

Usage: ``python -m bench.orchestration [--full] [--json PATH]``

Two sides run on the same digits sample with the same settings, each a fresh process in a project
folder of its own:

- ``pipeline``: ``imageops run --epochs E``, what a user types: the Prefect flow (a temporary
  Prefect API, retryable tasks, the training sub-flow, artifacts) with MLflow tracking and DVC
  versioning, as in ``make run``;
- ``plain``: the same steps called as plain Python functions, one after the other in one process
  (:func:`plain_steps`): convert, split, DVC-version the three data sets, build, train (the same
  torchrun launch), export, register, promote, score, evaluate. No Prefect API, flow or task.

First the startup costs, each alone in a fresh process: ``import prefect``, Prefect's server
code, Prefect's temporary API (a new database migrated, as on a machine's first project; a new
one from the machine's migrated copy; an existing one), MLflow's SQLite store (new: created and
migrated; existing) and DVC (init and the first version; again, unchanged). Then round 0 runs
each side in a new project (databases created, DVC initialised: a first run); the later rounds
run each side again in its project (what every later run pays), alternating which side goes
first. The ratio is pipeline / plain per round.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/orchestration.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import ROOT, Section, Stat, Table, run_main

GOAL = 1.15  # pipeline / plain, the goal
SIDES = ("pipeline", "plain")
STEP_TIMES = "plain-steps.json"  # what the plain side writes into its project folder
IMPORTS = "imports of the step library (timed in the plain side's process; both sides pay it)"


def plain_steps(epochs: int) -> dict[str, float]:
    """The pipeline's steps as plain calls, in flows/pipeline.py's order; seconds per step.

    A hand-written script using imageops as a library would look like this: no Prefect API, no
    tasks, no retries, no artifacts; the same data, settings, MLflow runs and DVC versions.
    """
    times: dict[str, float] = {}
    began = time.perf_counter()
    from tasks.shared.settings import get_settings

    settings = get_settings().apply()
    from flows.config import PipelineConfig
    from tasks.data.convert import convert
    from tasks.data.split import split
    from tasks.data.versioning import version
    from tasks.inference.evaluate import evaluate
    from tasks.inference.export import export_onnx
    from tasks.inference.score import score
    from tasks.registry.promote import CHALLENGER, promote
    from tasks.registry.register import register
    from tasks.train.build_model import build_model
    from tasks.train.launch import train
    from tasks.train.request import TrainRequest

    times["imports"] = time.perf_counter() - began
    config = PipelineConfig()
    params = config.train.model_copy(update={"epochs": epochs})
    data = settings.data_path / config.dataset_name  # the pipeline's folders: data/digits/...
    outputs = settings.home_dir / "outputs" / f"plain-{time.time_ns()}"

    def step(name: str, call, *args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        result = call(*args, **kwargs)
        times[name] = times.get(name, 0.0) + time.perf_counter() - start
        return result

    step("convert", convert, settings.project_root / config.source, data / "images")
    step("split", split, data / "images", data / "train", data / "val",
         fraction=config.split.fraction, seed=config.split.seed)  # fmt: skip
    data_version = {name: step("DVC version", version, data / name)
                    for name in ("images", "train", "val")}  # fmt: skip
    step("build model", build_model, config.model.name, outputs / "untrained",
         pretrained=config.model.pretrained)  # fmt: skip
    request = TrainRequest(model=outputs / "untrained", train_data=data / "train",
                           val_data=data / "val", out=outputs / "model", params=params,
                           transform=config.transform, data_version=data_version)  # fmt: skip
    trained = step("train (torchrun)", train, request)
    step("export ONNX", export_onnx, trained.model_dir, sample=data / "val")
    registered = step("register (MLflow)", register, trained.model_dir,
                      data_version=data_version, alias=CHALLENGER)  # fmt: skip
    step("promote (MLflow)", promote, data / "val", candidate=registered.version,
         metric=config.promotion.metric, margin=config.promotion.margin)  # fmt: skip
    scored = step("score", score, trained.model_dir, data / "val", outputs / "scored.csv",
                  batch_size=config.score_batch_size)  # fmt: skip
    step("evaluate", evaluate, scored, run_id=trained.run_id)
    return times


# The machine-level cache (the migrated Prefect database a new project starts from) of every
# child: the benchmark's own, so no earlier run on this machine changes what it measures.
CACHE_DIR = "XDG_CACHE_HOME"


def _child_env(cache: Path | None = None) -> dict[str, str]:
    """This environment without anything that would point a side at shared stores."""
    prefixes = ("IMAGEOPS_", "PREFECT_", "MLFLOW_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env["PYTHONPATH"] = str(ROOT)
    if cache is not None:
        env[CACHE_DIR] = str(cache)
    return env


def _new_project(path: Path, sample: Path) -> Path:
    """A project folder holding only ``data/raw/digits`` (hard links to the one written copy)."""
    shutil.copytree(sample, path / "data" / "raw" / "digits", copy_function=os.link)
    return path


def run_side(side: str, project: Path, epochs: int, cache: Path) -> float:
    """Wall seconds of one side in ``project``, interpreter start to exit, as a user sees it."""
    if side == "pipeline":
        command = [sys.executable, "-m", "app.cli", "run", "--epochs", str(epochs)]
    else:
        command = [sys.executable, "-m", "bench.orchestration", "--plain-steps", str(epochs)]
    log = project / f"{side}.log"
    start = time.perf_counter()
    with log.open("ab") as sink:
        done = subprocess.run(command, cwd=project, env=_child_env(cache), stdout=sink, stderr=sink)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"the {side} side failed (exit {done.returncode}); see {log}")
    return seconds


def _timed_python(code: str, cwd: Path, env: dict[str, str] | None = None) -> float:
    """Seconds the snippet reports (it prints one number), in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env={**_child_env(), **(env or {})},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"startup probe failed:\n{code}\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


PROBES = {
    "`import prefect` (part of the step library's imports; both sides)": (
        "import time; s = time.perf_counter(); import prefect; print(time.perf_counter() - s)"
    ),
    "Prefect's server code in the flow's process (Prefect's own start; avoided)": (
        "import prefect, time; s = time.perf_counter(); import prefect.server.api.server; "
        "print(time.perf_counter() - s)"
    ),
}


def _api_start(home: Path) -> str:
    return (
        "import time, pathlib; from app.temporary_api import start_temporary_api; "
        f"s = time.perf_counter(); api = start_temporary_api(pathlib.Path({str(home)!r}) / 'log'); "
        "api.wait(); "
        "print(time.perf_counter() - s)"
    )


def _mlflow_store(db: Path) -> str:
    return (
        "import time, mlflow; from mlflow import MlflowClient; s = time.perf_counter(); "
        f"MlflowClient('sqlite:///{db}').search_experiments(); print(time.perf_counter() - s)"
    )


def _dvc_first(project: Path) -> str:
    return (
        "import time; s = time.perf_counter(); from tasks.data.versioning import version; "
        f"version({str(project / 'data' / 'raw' / 'digits')!r}); print(time.perf_counter() - s)"
    )


def startup_costs(work: Path, sample: Path, repeats: int) -> dict[str, Stat]:
    """Each startup cost alone, ``repeats`` times, each in a fresh interpreter."""
    samples: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        samples.setdefault(name, []).append(seconds)

    for i in range(repeats):
        for name, code in PROBES.items():
            add(name, _timed_python(code, ROOT))
        home, cache = work / f"probe-{i}" / "prefect", work / f"probe-{i}" / "cache"
        env = {"PREFECT_HOME": str(home), CACHE_DIR: str(cache)}
        add("Prefect temporary API start, new database migrated (a machine's first project)",
            _timed_python(_api_start(home), ROOT, env))  # fmt: skip
        add("Prefect temporary API start, existing database (a project's later runs)",
            _timed_python(_api_start(home), ROOT, env))  # fmt: skip
        other = {**env, "PREFECT_HOME": str(work / f"probe-{i}" / "prefect-2")}
        add("Prefect temporary API start, new database from the machine's migrated copy",
            _timed_python(_api_start(Path(other["PREFECT_HOME"])), ROOT, other))  # fmt: skip
        db = work / f"probe-{i}" / "mlflow.db"
        add("MLflow SQLite store, new (tables created and migrated)",
            _timed_python(_mlflow_store(db), ROOT))  # fmt: skip
        add(
            "MLflow SQLite store, existing (schema checked)", _timed_python(_mlflow_store(db), ROOT)
        )
        project = _new_project(work / f"probe-{i}" / "dvc", sample)
        add("DVC: init and first version of the sample (1,797 files)",
            _timed_python(_dvc_first(project), project))  # fmt: skip
        add("DVC: version the unchanged sample again", _timed_python(_dvc_first(project), project))
    return {name: Stat(values, "s") for name, values in samples.items()}


def run(full: bool, work: Path) -> Section:
    from tasks.data.sample import write_digits

    epochs, warm_rounds, probe_repeats = (5, 3, 3) if full else (1, 2, 2)
    sample = write_digits(work / "sample")
    # First: it also leaves a migrated Prefect database in `cache`, as any earlier run would.
    costs = startup_costs(work, sample, probe_repeats)
    cache = work / "probe-0" / "cache"
    projects = {side: work / side for side in SIDES}
    cold: dict[str, list[float]] = {side: [] for side in SIDES}
    warm: dict[str, list[float]] = {side: [] for side in SIDES}
    for side in SIDES:
        _new_project(projects[side], sample)
        cold[side].append(run_side(side, projects[side], epochs, cache))
        print(f"round 0 (new project), {side}: {cold[side][-1]:.1f} s", flush=True)
    step_samples: dict[str, list[float]] = {}
    for round_ in range(1, warm_rounds + 1):
        for side in SIDES if round_ % 2 else reversed(SIDES):
            warm[side].append(run_side(side, projects[side], epochs, cache))
            print(f"round {round_}, {side}: {warm[side][-1]:.1f} s", flush=True)
        steps = json.loads((projects["plain"] / STEP_TIMES).read_text())
        for name, seconds in steps.items():
            step_samples.setdefault(name, []).append(seconds)

    def ratio(times: dict[str, list[float]]) -> Stat:
        return Stat([p / q for p, q in zip(times["pipeline"], times["plain"], strict=True)], "x")

    def extra(times: dict[str, list[float]]) -> Stat:
        return Stat([p - q for p, q in zip(times["pipeline"], times["plain"], strict=True)], "s")

    warm_ratio = ratio(warm)
    verdict = "met" if warm_ratio.median <= GOAL else "NOT MET"
    rows: list[list] = [
        ["first run in a new project", Stat(cold["pipeline"], "s"), Stat(cold["plain"], "s"),
         extra(cold), ratio(cold)],
        ["later runs in the same project", Stat(warm["pipeline"], "s"), Stat(warm["plain"], "s"),
         extra(warm), warm_ratio],
    ]  # fmt: skip
    return Section(
        key="orchestration",
        title="End to end: the pipeline flow vs the same steps as plain calls",
        command=f"python -m bench.orchestration{' --full' if full else ''}",
        text=[
            f"The digits sample (1,797 images, 32x32), the demo's settings (resnet18, "
            f"{epochs} epoch(s), 2 torchrun processes, batch 16), each side a fresh process in "
            "its own project folder. `pipeline` is `imageops run` (Prefect flow, temporary "
            "Prefect API, MLflow, DVC); `plain` calls the same step functions one after another "
            "in one process (MLflow and DVC included, no Prefect API, flow or task; it still "
            "imports Prefect, which the step modules use to define their tasks). Round 0 is "
            "each side's first run in a new project on a machine that has run imageops before "
            "(the startup probes ran first and left the migrated Prefect database a new project "
            "starts from); the later rounds run again in the same projects, alternating which "
            "side goes first.",
            f"**Goal pipeline / plain <= {GOAL}x on later runs: {verdict}** "
            f"({warm_ratio.format()}).",
        ],
        tables=[
            Table(["run", "pipeline", "plain", "pipeline - plain", "pipeline / plain"], rows),
            Table(
                ["startup cost, alone in a fresh process", "seconds"],
                [[IMPORTS, Stat(step_samples["imports"], "s")]]
                + [[name, stat] for name, stat in costs.items()],
                title=f"Startup costs ({probe_repeats} fresh processes each)",
            ),
            Table(
                ["step (plain side, later runs)", "seconds"],
                [[name, Stat(values, "s")] for name, values in step_samples.items()],
                title="Where the plain side's time goes",
            ),
        ],
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--plain-steps"]:  # the plain side, run by run_side in a project folder
        times = plain_steps(int(argv[1]))
        Path(STEP_TIMES).write_text(json.dumps(times))
        return 0
    return run_main(run, __doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    sys.exit(main())
