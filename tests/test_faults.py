"""The fault-injection hook (tasks.shared.faults): it fires at the point and fields named, nowhere
else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from server_processes import base_env

from tasks.data.datasets import dataset_lock
from tasks.shared import faults
from tasks.shared.settings import Settings

REACH = (
    "from tasks.shared import faults; "
    "faults.point('score.shard_written', shard=2, count=5); print('on')"
)


@pytest.mark.parametrize(
    ("fault", "returncode"),
    [
        ("score.shard_written:shard=2:kill", -signal.SIGKILL),
        ("score.shard_written:kill", -signal.SIGKILL),  # no condition: any shard
        ("score.shard_written:shard=3:kill", 0),  # another shard
        ("train.epoch_end:kill", 0),  # another point
        ("train.epoch_end:epoch=1:kill; score.shard_written:count=5:kill", -signal.SIGKILL),
        ("", 0),
    ],
)
def test_a_fault_kills_the_process_at_its_point_only(fault: str, returncode: int) -> None:
    done = subprocess.run(
        [sys.executable, "-c", REACH],
        env=base_env() | {faults.FAULT: fault},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == returncode, done.stderr
    assert done.stdout == ("on\n" if returncode == 0 else "")


def test_stop_freezes_the_process_at_its_point() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", REACH],
        env=base_env() | {faults.FAULT: "score.shard_written:stop"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)  # returns once it is stopped
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert out == "on\n"  # it goes on from the point when continued


def test_raise_raises_at_the_point(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.FAULT, "lock.acquired:name=data-x:raise")
    faults.point("lock.acquired", name="data-y")
    with pytest.raises(faults.InjectedFault, match=r"lock\.acquired"):
        faults.point("lock.acquired", name="data-x")


@pytest.mark.parametrize(
    ("fault", "problem"),
    [("score.shard_written:rank=1:kill", "has no 'rank'"), ("score.shard_written:boom", "boom")],
)
def test_a_fault_that_cannot_fire_as_written_is_an_error(
    monkeypatch: pytest.MonkeyPatch, fault: str, problem: str
) -> None:
    monkeypatch.setenv(faults.FAULT, fault)
    with pytest.raises(ValueError, match=problem):
        faults.point("score.shard_written", shard=0, count=1)


def test_the_trace_lists_the_points_reached_in_order(
    project: Settings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    trace = tmp_path / "trace"
    monkeypatch.setenv(faults.TRACE, str(trace))
    with dataset_lock(project, "a"), dataset_lock(project, "b"):
        pass
    lines = [line.split(" ", 1)[1] for line in trace.read_text().splitlines()]
    assert faults.reached(trace, "lock.released")[0]["name"] == "data-b"
    assert lines == [
        "lock.acquired name=data-a",
        "lock.acquired name=data-b",
        "lock.released name=data-b",
        "lock.released name=data-a",
    ]
