"""Test hosts that share nothing but the network: Linux network namespaces on a bridge.

Each host has its own network stack and address (``10.231.N.k``), its own hostname (a UTS
namespace per command), its own copy of the project's code and its own IMAGEOPS_HOME; the root
namespace holds the bridge (``10.231.N.254``), where the tests run their servers. Needs root and
``ip`` (CI runs as root); :func:`can_make_hosts` says why not otherwise. Every namespace, veth and
the bridge are removed at the end, even when a test fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from server_processes import ROOT, Processes, base_env

# The project's code, copied for each host (the virtual environment's packages are the
# machine's software, like /usr: shared read-only; the project's own code is not).
CODE = ("app", "flows", "tasks", "models", "deployments", "pyproject.toml", "tuning.yaml")


def can_make_hosts() -> str | None:
    """None when this process can make namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs iproute2's `ip` and util-linux's `unshare`"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    """One simulated machine: a namespace, an address, a folder of its own."""

    name: str  # its hostname
    netns: str
    address: str
    root: Path  # everything of this host: code, home, data
    env: dict[str, str] = field(default_factory=dict)

    @property
    def project(self) -> Path:
        return self.root / "project"

    @property
    def home(self) -> Path:
        return self.root / "home"

    def command(self, args: list[str]) -> list[str]:
        """``args`` run inside this host: its network namespace and a hostname of its own."""
        script = 'hostname "$0" && cd "$1" && shift && exec "$@"'
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--",
                "sh", "-c", script, self.name, str(self.project), *args]  # fmt: skip

    def run(
        self, args: list[str], timeout_s: float = 600, **env: str
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(args),
            cwd=self.project,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )


class Hosts:
    """``count`` hosts on a bridge; use as a context manager (everything removed on exit)."""

    def __init__(self, root: Path, count: int = 2) -> None:
        # One subnet per test process, so parallel test workers never share a bridge.
        self.net = 20 + os.getpid() % 200
        self.bridge = f"iob{self.net}"
        self.gateway = f"10.231.{self.net}.254"
        self.hosts = [
            Host(
                name=f"host-{chr(ord('a') + i)}",
                netns=f"imageops-{self.net}-{i}",
                address=f"10.231.{self.net}.{i + 1}",
                root=root / f"host-{chr(ord('a') + i)}",
            )
            for i in range(count)
        ]
        self.processes = Processes(root / "logs")

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self._remove()
            raise
        return self

    def _make(self) -> None:
        self._remove()  # leftovers of a killed earlier run with this pid's subnet
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, host in enumerate(self.hosts):
            veth = f"iov{self.net}x{i}"
            _ip("netns", "add", host.netns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _copy_code(host.project)
            host.home.mkdir(parents=True)
            host.env = base_env() | {
                "PYTHONPATH": str(host.project),
                "IMAGEOPS_PROJECT_ROOT": str(host.project),
                "IMAGEOPS_HOME": str(host.home),
                "RAY_USAGE_STATS_ENABLED": "0",
                "HOME": str(host.root),
            }

    def start(self, host: Host, name: str, args: list[str], **env: str) -> subprocess.Popen:
        """A long-running process on ``host`` (logged, stopped at the end)."""
        return self.processes.start(f"{host.name}-{name}", host.command(args), host.env | env)

    def power_off(self, host: Host, timeout_s: float = 30.0) -> None:
        """Every process of ``host`` SIGKILLed, as a machine that loses power; returns once
        none is left (a process forked meanwhile is killed in the next round)."""
        deadline = time.monotonic() + timeout_s
        while pids := subprocess.run(
            ["ip", "netns", "pids", host.netns], capture_output=True, text=True
        ).stdout.split():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{host.name} still runs {pids} after {timeout_s} s")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        self.processes.stop()
        self._remove()

    def _remove(self) -> None:
        for host in self.hosts:
            self.power_off(host)  # no stray Ray node or worker outlives its namespace
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", host.netns)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", self.bridge)


def _copy_code(dest: Path) -> None:
    dest.mkdir(parents=True)
    for name in CODE:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, dest / name)
