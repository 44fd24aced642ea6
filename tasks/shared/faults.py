"""Fault injection for the fault tests: a process fails at a named point, not when a poller hits it.

A poller racing a worker on a loaded machine may miss its window; a process failing itself at
the exact point makes the test deterministic. ``IMAGEOPS_FAULT="POINT[:KEY=VALUE...]:ACTION"``
(``;`` between faults; actions kill, kill_parent, stop, hang, raise), e.g.
``train.epoch_end:rank=1:epoch=1:kill``; ``IMAGEOPS_FAULT_TRACE`` names a file logging every point
reached, in order. Unset, :func:`point` costs nothing. Details: docs/faults.md.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

FAULT = "IMAGEOPS_FAULT"
TRACE = "IMAGEOPS_FAULT_TRACE"
ACTIONS = ("kill", "kill_parent", "stop", "hang", "raise")
# ``hang``: a step that takes far longer than it should, yet answers signals (``stop`` does not).
HANG_S = 3600.0


class InjectedFault(RuntimeError):
    """Raised by the ``raise`` action: an error nobody expects, at a chosen point."""


def point(name: str, /, **fields: object) -> None:
    """Trace reaching point ``name`` with ``fields`` and fire the faults that match it."""
    trace, faults = os.environ.get(TRACE), os.environ.get(FAULT)
    if trace:
        _trace(trace, name, fields)
    if faults:
        for spec in faults.split(";"):
            action = _matching_action(spec.strip(), name, fields)
            if action is not None:
                _fire(action, spec)


def reached(trace: Path, name: str) -> list[dict[str, str]]:
    """The fields (and ``pid``) of each time point ``name`` was reached, from the ``trace`` file."""
    found = []
    for line in trace.read_text().splitlines():
        pid, where, *fields = line.split(" ")
        if where == name:
            found.append({"pid": pid, **dict(f.split("=", 1) for f in fields)})
    return found


def _trace(path: str, name: str, fields: dict[str, object]) -> None:
    line = " ".join([str(os.getpid()), name, *(f"{k}={v}" for k, v in fields.items())]) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _matching_action(spec: str, name: str, fields: dict[str, object]) -> str | None:
    """The action of ``spec`` when it is a fault at point ``name`` matching ``fields``."""
    target, *conditions, action = spec.split(":")
    if target != name:
        return None
    if action not in ACTIONS:
        raise ValueError(f"{FAULT}={spec!r}: action {action!r} is not one of {ACTIONS}")
    for condition in conditions:
        key, _, value = condition.partition("=")
        if key not in fields:
            raise ValueError(f"{FAULT}={spec!r}: point {name} has no {key!r} ({sorted(fields)})")
        if str(fields[key]) != value:
            return None
    return action


def _fire(action: str, spec: str) -> None:
    if action == "raise":
        raise InjectedFault(f"injected by {FAULT}={spec!r}")
    if action == "hang":  # in slices: a signal taken by another thread is raised here within 1 s
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline:
            time.sleep(1.0)
        return
    if action == "kill_parent":
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGSTOP if action == "stop" else signal.SIGKILL)
