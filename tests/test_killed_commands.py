"""A killed command leaves no processes and no litter (issue 18).

Each test starts a real ``imageops`` command, waits until the processes it starts exist, then
SIGKILLs the command's own process only (as ``kill -9 PID`` or the OOM killer does: not its
process group), and checks that every process it had started is gone within seconds. Then the
same command run again removes what the killed one left beside its output (``.<name>.<8>.tmp``,
``.<name>.<8>.old``, ``.<name>.extract-<8>``, ``.<name>.shards-<8>``), but never a live run's
(each is locked while in use) and never anything that is not provably its own.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import yaml
from projects import imageops

from models.transform_spec import TransformSpec
from models.untrained import resnet, write_untrained
from tasks.data.convert import convert
from tasks.data.sample import write_digits
from tasks.data.transform import init_transformation
from tasks.inference.score import score_in_shards
from tasks.shared import faults
from tasks.shared.settings import Settings

pytest_plugins = ["model_fixtures"]

GONE_WITHIN_S = 20.0  # a loader process notices a dead training process at once; slack for load
STARTED_WITHIN_S = 240.0  # imports on a loaded 2-core machine
TINY = TransformSpec(resize_size=8, center_crop_size=8, random_horizontal_flip=False)


def _start(argv: list[str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    """``imageops argv`` in a session of its own; stdout is a pipe, as a caller's would be."""
    cwd.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as sink:  # a file: a full stderr pipe would stall the command
        return subprocess.Popen(
            [sys.executable, "-m", "app.cli", *argv],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=sink,
            start_new_session=True,
            env=os.environ | {"PYTHONFAULTHANDLER": "1"},  # SIGABRT: every thread's stack
        )


def _cmdline(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(proc.cmdline())
    return ""


def _alive(proc: psutil.Process) -> bool:
    """Running, and the same process (psutil compares start times: a reused pid is not it)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _tree_when(
    command: subprocess.Popen[bytes],
    ready: Callable[[list[psutil.Process]], bool],
    log: Path,
) -> list[psutil.Process]:
    """Every process below ``command`` once ``ready`` says they are all there."""
    root = psutil.Process(command.pid)
    deadline = time.monotonic() + STARTED_WITHIN_S
    while time.monotonic() < deadline and command.poll() is None:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree = root.children(recursive=True)
            if ready(tree):
                return tree
        time.sleep(0.2)  # psutil reads all of /proc each time: faster polls took a core
    pytest.fail(f"the processes did not appear (exit {command.poll()}): {log.read_text()[-3000:]}")


def _count(tree: list[psutil.Process], *marks: str, without: str = "\0") -> int:
    return sum(all(m in c for m in marks) and without not in c for c in map(_cmdline, tree))


def _survivors(tree: list[psutil.Process]) -> list[str]:
    """The processes of ``tree`` still alive after GONE_WITHIN_S (none, we hope)."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while time.monotonic() < deadline:
        alive = [p for p in tree if _alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [f"{p.pid}: {_cmdline(p)[:120]}" for p in tree if _alive(p)]


@contextlib.contextmanager
def _cleanup(command: subprocess.Popen[bytes]) -> Iterator[list[psutil.Process]]:
    """Yields a list to put the command's processes in; kills whatever is left of them after."""
    tree: list[psutil.Process] = []
    try:
        yield tree
    finally:
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(command.pid, signal.SIGKILL)
        command.wait()
        assert command.stdout is not None
        command.stdout.close()


def _kill_and_check(command: subprocess.Popen[bytes], tree: list[psutil.Process]) -> None:
    """SIGKILL the command's process alone; all of ``tree`` must die with it."""
    os.kill(command.pid, signal.SIGKILL)
    assert command.wait(timeout=10) == -signal.SIGKILL
    assert _survivors(tree) == []


def _stop_and_check(
    command: subprocess.Popen[bytes],
    tree: list[psutil.Process],
    stop: Callable[[], None],
    log: Path,
) -> None:
    """``stop()`` the command (a signal as a terminal or a scheduler sends it): it must end,
    all of ``tree`` with it, within 10 s. One that does not is shown with its ``log``, which
    ends with every thread's stack."""
    pressed = time.monotonic()
    stop()
    try:
        assert command.wait(timeout=60) != 0
    except subprocess.TimeoutExpired:  # where it was stuck: its log ends with its stacks
        command.send_signal(signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            command.wait(timeout=20)
        pytest.fail(f"still running 60 s after the stop; the end of {log}:\n"
                    f"{log.read_text(errors='replace')[-8000:]}")  # fmt: skip
    took = time.monotonic() - pressed
    assert _survivors(tree) == []
    assert took < 10, f"the command took {took:.1f} s to stop"


def _run_statuses(settings: Settings) -> list[tuple[str, str]]:
    """Every MLflow run of the project: (name, status)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(settings.tracking_uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return [(r.info.run_name, r.info.status) for r in runs]


def _kinds(folder: Path, name: str) -> list[str]:
    """What each entry beside ``folder/name`` is, by the temporary names imageops gives."""
    name = re.escape(name)
    kinds = {
        "tmp": rf"\.{name}\.[0-9a-f]{{8}}\.tmp",
        "old": rf"\.{name}\.[0-9a-f]{{8}}\.old",
        "extract": rf"\.{name}\.extract-[0-9a-f]{{8}}",
        "shards": rf"\.{name}\.shards-[0-9a-f]{{8}}",
        "output": name,
    }
    return sorted(
        next((k for k, pattern in kinds.items() if re.fullmatch(pattern, p.name)), p.name)
        for p in folder.iterdir()
    )


def test_a_killed_convert_leaves_no_process_and_the_next_run_removes_its_leftovers(
    tmp_path: Path,
) -> None:
    digits = write_digits(tmp_path / "digits", size=8)  # all 1,797: the pool is busy a while
    archive = Path(shutil.make_archive(str(tmp_path / "digits"), "zip", digits))
    data = tmp_path / "data"
    argv = ["convert", str(archive), str(data / "images"), "--workers", "3"]
    log = tmp_path / "convert.log"
    command = _start(argv, tmp_path / "work", log)
    with _cleanup(command) as tree:
        # Two spawned pool workers (checking images) and multiprocessing's resource tracker.
        tree += _tree_when(
            command, lambda t: _count(t, "spawn_main") >= 2 and _count(t, "resource_tracker"), log
        )
        _kill_and_check(command, tree)
        # Nothing holds the caller's stdout any more: reading it ends.
        assert command.stdout is not None
        assert command.stdout.read() == b""
    # The archive's extraction, and the ImageDirectory being written.
    assert _kinds(data, "images") == ["extract", "tmp"]

    again = imageops(*argv, cwd=tmp_path / "work")
    assert again.returncode == 0, again.stderr
    assert "1797 images, 10 classes" in again.stdout
    assert _kinds(data, "images") == ["output"]


# Writes ``dest`` through every kind of temporary folder convert uses, and stops half-way: its
# extraction folder and a folder being written are open while a second write of ``dest`` has
# swapped the previous output aside (``.old``) and is removing it.
HOLDER = """
import shutil, sys, time
from pathlib import Path
from models import atomic
from models.atomic import atomic_directory, scratch_folder

dest = Path(sys.argv[1])
remove = shutil.rmtree
def stuck(path, *args, **kwargs):
    if str(path).endswith(".old"):
        print("holding", flush=True)
        time.sleep(600)
    remove(path, *args, **kwargs)
atomic.shutil.rmtree = stuck
dest.mkdir(parents=True, exist_ok=True)
with scratch_folder(dest, "extract"), atomic_directory(dest), atomic_directory(dest):
    pass
"""

# A scoring into ``dest`` that cannot share the checkpoint, stopped before its merge is done.
SCORE_HOLDER = """
import sys, time
from pathlib import Path
from models.atomic import atomic_file, scratch_folder

dest = Path(sys.argv[1])
with scratch_folder(dest, "shards"), atomic_file(dest):
    print("holding", flush=True)
    time.sleep(600)
"""


@contextlib.contextmanager
def _holding(script: str, dest: Path) -> Iterator[tuple[subprocess.Popen[str], set[Path]]]:
    """A process running ``script`` on ``dest``, and the paths beside ``dest`` it made."""
    before = set(dest.parent.iterdir()) if dest.parent.is_dir() else set()
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(dest)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == "holding\n", line + proc.stdout.read()
        assert before <= set(dest.parent.iterdir())  # it removed nothing that was held
        yield proc, set(dest.parent.iterdir()) - before - {dest}
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def test_the_next_run_removes_only_leftovers_that_no_live_run_holds(tmp_path: Path) -> None:
    images = write_digits(tmp_path / "digits", size=8, classes=[0, 1], per_class=5)
    data = tmp_path / "data"
    dest = data / "images"
    other = tmp_path / "elsewhere"
    other.mkdir()
    lookalikes = [
        data / ".images.tmp",  # no random part
        data / "images.0123abcd.tmp",  # no leading dot
        data / ".imagesX.0123abcd.tmp",  # another output's
        data / ".images.0123abcd.tmp.keep",
    ]
    link = data / ".images.0123abcd.old"  # the right name, but a link: never followed

    with _holding(HOLDER, dest) as (_, held):
        with _holding(HOLDER, dest) as (killed, left):
            pass  # SIGKILLed on leaving
        assert killed.returncode == -signal.SIGKILL
        assert _kinds(data, "images") == sorted(["output", *["extract", "old", "tmp"] * 2])
        for path in lookalikes:
            path.write_text("not imageops'")
        link.symlink_to(other, target_is_directory=True)

        convert(images, dest)

        assert [p for p in left if os.path.lexists(p)] == []
        assert all(p.exists() for p in held)  # its writer still runs
        assert all(p.read_text() == "not imageops'" for p in lookalikes)
        assert link.is_symlink() and other.is_dir()
    convert(images, dest)  # a cache hit writes nothing, and still removes the leftovers
    assert sorted(data.iterdir()) == sorted([dest, link, *lookalikes])


def test_score_removes_a_killed_runs_private_shards_and_table(
    exported_model: Path, tmp_path: Path
) -> None:
    images = write_digits(tmp_path / "photos", size=8, classes=[0, 1], per_class=4)
    dest = tmp_path / "scores" / "out.csv"
    with _holding(SCORE_HOLDER, dest) as (_, held):
        with _holding(SCORE_HOLDER, dest) as (_, left):
            pass
        assert _kinds(dest.parent, "out.csv") == ["shards", "shards", "tmp", "tmp"]

        score_in_shards(exported_model, images, dest, shard_images=4, batch_size=4, threads=1)

        assert set(dest.parent.iterdir()) == {dest, *held}  # the live run's, untouched
    assert not any(os.path.lexists(p) for p in left)


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["SIGKILL", "Ctrl-C"])
def test_a_killed_or_interrupted_score_leaves_no_reader_process(
    exported_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: str
) -> None:
    """Score's reader processes (issue 45) die with a SIGKILLed command; Ctrl-C (SIGINT to the
    process group, readers included) ends it within 10 s, nothing left running, no table."""
    images = write_digits(tmp_path / "photos", size=8, classes=[0, 1], per_class=4)
    trace = tmp_path / "trace"
    monkeypatch.setenv(faults.TRACE, str(trace))
    monkeypatch.setenv(faults.FAULT, "score.image_read:hang")  # readers busy until stopped
    dest = tmp_path / "scores" / "out.csv"
    argv = ["score", str(exported_model), str(images), str(dest), "--threads", "2"]
    argv += ["--batch-size", "4"]  # two batches: one for each reader
    log = tmp_path / "score.log"
    command = _start(argv, tmp_path / "work", log)

    def reading(tree: list[psutil.Process]) -> bool:
        # The fork server and its two readers, each in its first image.
        read = trace.exists() and faults.reached(trace, "score.image_read")
        return _count(tree, "forkserver") >= 3 and len({r["pid"] for r in read or []}) >= 2

    with _cleanup(command) as tree:
        tree += _tree_when(command, reading, log)
        readers = {int(r["pid"]) for r in faults.reached(trace, "score.image_read")}
        assert command.pid not in readers and readers <= {p.pid for p in tree}
        if stop == "SIGKILL":
            _kill_and_check(command, tree)
        else:
            _stop_and_check(command, tree, lambda: os.killpg(command.pid, signal.SIGINT), log)
            assert "Traceback" not in log.read_text(errors="replace")
    assert not dest.exists()


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["SIGKILL", "Ctrl-C", "SIGTERM"])
def test_a_killed_or_stopped_train_leaves_no_torchrun_worker_or_loader(
    project: Settings, tmp_path: Path, stop: str
) -> None:
    """SIGKILL: everything dies with the command. Ctrl-C (SIGINT to the process group, as a
    terminal sends it, workers and loaders included) or SIGTERM (a scheduler's stop): it ends
    within 10 s, nothing left running, no traceback, its MLflow run KILLED."""
    root = tmp_path / "in"
    digits = write_digits(root / "digits", size=8, classes=[0, 1, 2], per_class=8)
    convert(digits, root / "train")
    untrained = write_untrained(resnet("resnet18", pretrained=False), root / "untrained")
    transform = init_transformation(root / "transform", TINY)
    argv = [
        "train", str(untrained), str(root / "train"), str(root / "train"), str(tmp_path / "model"),
        "--transform", str(transform), "--epochs", "1000", "--patience", "1000",
        "--batch-size", "4", "--device", "cpu", "--precision", "fp32", "--nproc-per-node", "2",
        "--num-workers", "1",
    ]  # fmt: skip
    log = tmp_path / "train.log"
    command = _start(argv, project.project_root, log)
    signals = {
        "Ctrl-C": lambda: os.killpg(command.pid, signal.SIGINT),
        "SIGTERM": lambda: os.kill(command.pid, signal.SIGTERM),
    }
    with _cleanup(command) as tree:
        # torchrun, its two workers, and each worker's fork server with its loader process.
        tree += _tree_when(command, _training_with_loaders, log)
        if stop == "SIGKILL":
            _kill_and_check(command, tree)
        else:
            _stop_and_check(command, tree, signals[stop], log)
    assert not (tmp_path / "model").exists()
    if stop != "SIGKILL":
        text = log.read_text(errors="replace")
        assert "Traceback" not in text, text[-3000:]
        assert [status for _, status in _run_statuses(project)] == ["KILLED"]


@pytest.mark.slow
def test_ctrl_c_or_sigterm_ends_imageops_run_within_10_s_and_the_same_run_again_resumes(
    project: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) after epoch 1's checkpoint,
    then SIGTERM (a scheduler's stop) to the same command run again, after epoch 2's: each ends
    within 10 s, nothing of it left running, its flow runs Crashed (a final state), the MLflow
    run KILLED, no traceback. The second continued the first's MLflow run from its checkpoint
    (it trained epoch 2 alone), in the same outputs folder."""
    source = write_digits(tmp_path / "digits", size=8, classes=[0, 1], per_class=10)
    params = tmp_path / "params.yaml"  # the steps around training that this does not need
    params.write_text(yaml.safe_dump({"version_data": False, "quantize": False}))
    argv = ["run", str(source), "--config", str(params), "--epochs", "3", "--nproc-per-node", "1"]

    def stopped_after(epoch: int, stop: Callable[[subprocess.Popen[bytes]], None]) -> str:
        trace = tmp_path / f"stopped-after-{epoch}.trace"
        monkeypatch.setenv(faults.TRACE, str(trace))
        monkeypatch.setenv(faults.FAULT, f"train.epoch_end:epoch={epoch}:hang")
        log = tmp_path / f"stopped-after-{epoch}.log"
        command = _start(argv, project.project_root, log)

        def after_the_epoch(tree: list[psutil.Process]) -> bool:
            return trace.is_file() and bool(faults.reached(trace, "train.epoch_end"))

        with _cleanup(command) as tree:
            tree += _tree_when(command, after_the_epoch, log)
            _stop_and_check(command, tree, lambda: stop(command), log)
        text = log.read_text(errors="replace")
        assert "Traceback" not in text and "ConnectError" not in text, text[-3000:]
        assert "Finished in state Crashed" in text, text[-3000:]
        assert [int(e["epoch"]) for e in faults.reached(trace, "train.epoch_end")] == [epoch]
        [(name, status)] = _run_statuses(project)
        assert status == "KILLED"
        return name

    name = stopped_after(1, lambda command: os.killpg(command.pid, signal.SIGINT))
    [outputs] = project.outputs_dir.iterdir()
    # The same command again: the same MLflow run (KILLED again) went on from epoch 1's
    # checkpoint, into the same outputs folder.
    assert stopped_after(2, lambda command: os.kill(command.pid, signal.SIGTERM)) == name
    assert list(project.outputs_dir.iterdir()) == [outputs]
    [run_dir] = project.runs_dir.iterdir()
    assert "resumed from the checkpoint after epoch 1" in (run_dir / "rank_0.log").read_text()


def _ppid(proc: psutil.Process) -> int | None:
    with contextlib.suppress(psutil.Error):
        return proc.ppid()
    return None


def _training_with_loaders(tree: list[psutil.Process]) -> bool:
    """torchrun, 2 workers, and below each its fork server with a loader process."""
    workers = {
        p.pid
        for p in tree
        if "-m tasks.train.worker" in _cmdline(p) and "torch.distributed.run" not in _cmdline(p)
    }
    servers = {p.pid for p in tree if "forkserver" in _cmdline(p) and _ppid(p) in workers}
    loaders = {_ppid(p) for p in tree if "forkserver" in _cmdline(p) and _ppid(p) in servers}
    return (
        _count(tree, "torch.distributed.run") == 1
        and len(workers) == len(servers) == 2
        and loaders == servers
    )


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_or_stopped_tune_leaves_no_trial_process_or_api_server(
    project: Settings, tmp_path: Path, sig: signal.Signals
) -> None:
    """SIGKILL: everything dies with the command. SIGTERM (a stop, as `kill` or a scheduler
    sends it): within 10 s, running trials included, and their MLflow runs end KILLED."""
    root = tmp_path / "in"
    digits = write_digits(root / "digits", size=8, classes=[0, 1], per_class=8)
    convert(digits, root / "train")
    transform = init_transformation(root / "transform", TINY)
    spec = root / "tuning.yaml"
    train = {"epochs": 1000, "patience": 1000, "batch_size": 4, "device": "cpu"}
    train |= {"precision": "fp32", "nproc_per_node": 1}
    parameters = [{"name": "learning_rate", "type": "categorical", "values": [0.01, 0.02]}]
    spec.write_text(
        yaml.safe_dump(
            {
                "study_name": "killed",
                "algorithm": "grid",
                "max_trial_count": 2,
                "parallel_trial_count": 2,
                "parameters": parameters,
                "train": train,
            }
        )
    )
    data = ["--train-data", str(root / "train"), "--val-data", str(root / "train")]
    argv = ["tune", str(spec), *data, "--transform", str(transform), "--no-register"]
    log = tmp_path / "tune.log"
    command = _start(argv, project.project_root, log)
    with _cleanup(command) as tree:
        # The temporary Prefect API server, and two trials training at once: torchrun and worker.
        tree += _tree_when(command, _two_trials_training, log)
        if sig == signal.SIGKILL:
            _kill_and_check(command, tree)
            return
        _stop_and_check(command, tree, lambda: os.kill(command.pid, signal.SIGTERM), log)
    statuses = _run_statuses(project)
    assert statuses and all(status != "RUNNING" for _, status in statuses), statuses


def _two_trials_training(tree: list[psutil.Process]) -> bool:
    workers = _count(tree, "-m tasks.train.worker", without="torch.distributed.run")
    return _count(tree, "uvicorn") == 1 and _count(tree, "torch.distributed.run") == 2 == workers
