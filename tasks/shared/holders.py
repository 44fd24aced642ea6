"""Who holds something shared: this process as another one can name it and tell whether it runs.

An owner record (a tuning study's, a scored table's lease) names its holder by host, pid and the
process's start time: a pid is reused, a pid with its start time is not. It also names the
machine (boot id and PID namespace), since two containers may share a host name and a
network-namespace host its kernel. Only on the holder's own machine can another process tell
whether it still runs; elsewhere it cannot, and waits for the holder's deadline instead.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any

import psutil

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_PID_NAMESPACE = "/proc/self/ns/pid"


def _machine() -> str:
    """This kernel's boot and this process's PID namespace ("" where there is no /proc)."""
    parts = []
    with contextlib.suppress(OSError):
        parts.append(_BOOT_ID.read_text().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink(_PID_NAMESPACE))
    return " ".join(parts)


def this_process() -> dict[str, Any]:
    """This process as an owner record names it: ``host``, ``pid``, ``started`` (its start,
    seconds since the epoch) and ``machine``."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": psutil.Process().create_time(),
        "machine": _machine(),
    }


def running_here(holder: dict[str, Any]) -> bool | None:
    """Whether the process ``holder`` names (:func:`this_process`) still runs: None when it is on
    another machine, where nobody here can tell."""
    if holder.get("host") != socket.gethostname():
        return None
    if holder.get("machine", _machine()) != _machine():  # records without one: the host's word
        return None
    try:
        return abs(psutil.Process(int(holder["pid"])).create_time() - holder["started"]) < 1.0
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False
