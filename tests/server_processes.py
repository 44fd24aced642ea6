"""Real servers in tests: free ports, a clean environment, processes that always stop.

Shared by the tests that start `prefect server`, `mlflow server`, the receiver or `imageops
serve` as subprocesses (test_promotion_webhook, test_postgres, test_stack, test_team), and Ray
clusters (test_cluster, test_cluster_hosts).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tasks.shared import servers
from tasks.shared.servers import free_port, healthy

__all__ = [
    "LONG_WAIT",
    "PROMPT_WORKER",
    "RAY_NODE",
    "Processes",
    "base_env",
    "free_port",
    "healthy",
]
ROOT = Path(__file__).resolve().parents[1]
# A Prefect worker the tests start looks for work (and for cancellations) every second, not
# every 10 s: each run a test hands it would otherwise wait up to 10 s to start.
PROMPT_WORKER = {"PREFECT_WORKER_QUERY_SECONDS": "1"}
# A Ray node the tests start does not drain on SIGTERM: `ray start --block` drains for up to
# 30 s (for Ray Serve's replicas), so each stop waited out its 10 s timeout and was SIGKILLed.
# Its workers run at nice 0, not Ray's 15: beside them `make test`'s other pytest worker trains
# at nice 0, and a nice-15 task then gets a few % of a core (a 20 s cluster scoring took 4-8 min
# beside two or three busy processes).
RAY_NODE = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "RAY_worker_niceness": "0"}
# How a test polls through a wait that can last minutes (servers.wait_until's pacing): prompt at
# first, then every 2 s at most. A check that makes a client and a server request every 0.5 s
# through a training took 36 CPU-seconds of a run (py-spy), and the servers answered each.
LONG_WAIT = {"interval_s": 0.25, "max_interval_s": 2.0}


def base_env() -> dict[str, str]:
    """This environment without any Prefect, MLflow or imageops setting, telemetry off."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_", "MLFLOW_", "IMAGEOPS_"))
    }
    return env | {
        "PYTHONPATH": str(ROOT),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "1",
        # No job runner in `mlflow server` (evaluation jobs, schedulers): a test needs none, and
        # its half-dozen huey consumers held a third of a core and 1.4 GB for as long as it ran.
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }


class Processes:
    """Subprocesses in their own process groups, logging to files; all killed at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs, self.started = logs, []
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        proc = servers.start(args, self.logs / f"{name}.log", env, cwd=ROOT)
        self.started.append((name, proc))
        return proc

    def report(self) -> str:
        """The end of every process's log, for a failure message."""
        parts = []
        for name, proc in self.started:
            text = (self.logs / f"{name}.log").read_text(errors="replace")
            parts.append(f"----- {name} (exit {proc.poll()}) -----\n{text[-4000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """All at once, as ``imageops serve`` stops its stack: one timeout, not one each (a
        team's nine processes took up to 25 s one after the other)."""
        servers.stop_together([proc for _, proc in reversed(self.started)])

    def crash(self, proc: subprocess.Popen) -> None:
        """SIGKILL ``proc``'s whole process group, as a crash would; it is not waited for again.

        Its log stays in the folder; start its replacement under another name.
        """
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        self.started = [(name, p) for name, p in self.started if p is not proc]

    def wait(self, what: str, ready: Callable[[], Any], timeout_s: float = 120.0) -> Any:
        """Poll ``ready`` until it returns something truthy; fail with every log if never."""

        def attempt() -> Any:
            with contextlib.suppress(httpx.HTTPError):
                if result := ready():
                    return result
            dead = [name for name, proc in self.started if proc.poll() is not None]
            if dead:
                pytest.fail(f"{', '.join(dead)} exited while waiting for {what}\n{self.report()}")
            return None

        result = servers.wait_until(attempt, timeout_s, **LONG_WAIT)
        if not result:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{self.report()}")
        return result
