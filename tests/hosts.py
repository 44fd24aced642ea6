"""Test hosts that share nothing but the network: Linux namespaces on a bridge.

Each host is a machine of its own as far as its processes can tell: its own network stack and
address (``10.231.N.k``), PID namespace and ``/proc`` (its processes see only each other), hostname,
copy of the project's code, and home (``HOME``). The root namespace holds the bridge
(``10.231.N.254``), where the tests run their servers. A host's first process is a small init
that reaps orphans, as a machine's does; every command of the host enters its namespaces with
``nsenter``. Needs root, ``ip`` and util-linux (CI runs as root); :func:`can_make_hosts` says why
not otherwise. Every namespace, veth and the bridge are removed at the end, even when a test
fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from server_processes import ROOT, Processes, base_env

from tasks.shared import servers
from tasks.shared.parent_death import dying_with_this_process

# The project's code, copied for each host (the virtual environment's packages are the
# machine's software, like /usr: shared read-only; the project's own code is not).
CODE = ("app", "flows", "tasks", "models", "deployments", "pyproject.toml", "tuning.yaml")
# PID 1 of a host: names the machine, says it is up, then reaps every orphan until killed.
INIT = """
import os, socket, sys, time
socket.sethostname(sys.argv[1])
open(sys.argv[2], "w").close()
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.5)
"""
BOOT_TIMEOUT_S = 30.0


def can_make_hosts() -> str | None:
    """None when this process can make namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if not all(shutil.which(tool) for tool in ("ip", "unshare", "nsenter")):
        return "needs iproute2's `ip` and util-linux's `unshare` and `nsenter`"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    """One simulated machine: namespaces, an address, a folder of its own."""

    name: str  # its hostname
    netns: str
    address: str
    root: Path  # everything of this host: code, home, data
    env: dict[str, str] = field(default_factory=dict)
    init: int = 0  # its PID 1, as this (the root) PID namespace numbers it; 0: powered off

    @property
    def project(self) -> Path:
        """The host's checkout of the project (its code, its data)."""
        return self.root / "project"

    @property
    def home(self) -> Path:
        """The home folder of the host's user (HOME)."""
        return self.root / "home"

    def command(self, args: list[str]) -> list[str]:
        """``args`` run on this host, in its checkout: inside every namespace of its init."""
        assert self.init, f"{self.name} is powered off"
        return ["nsenter", f"--target={self.init}", "--net", "--uts", "--pid", "--mount",
                "--", "sh", "-c", 'cd "$0" && exec "$@"', str(self.project), *args]  # fmt: skip

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

    def pids(self) -> list[int]:
        """Every process of this host (its network namespace's), as this namespace numbers it."""
        listed = subprocess.run(
            ["ip", "netns", "pids", self.netns], capture_output=True, text=True, check=False
        )
        return [int(pid) for pid in listed.stdout.split()]

    def processes_running(self, *words: str) -> dict[int, str]:
        """The processes of this host whose command line holds any of ``words``: pid, command."""
        found = {}
        for pid in self.pids():
            with contextlib.suppress(OSError):  # ended meanwhile
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                if any(word in command for word in words):
                    found[pid] = command.strip()
        return found


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
            host.env = {k: v for k, v in base_env().items() if not k.startswith("XDG_")} | {
                "PYTHONPATH": str(host.project),
                "RAY_USAGE_STATS_ENABLED": "0",
                "HOME": str(host.home),
            }
            self.boot(host)

    def boot(self, host: Host) -> None:
        """Start ``host``'s init: a new PID namespace with its own /proc, and its hostname."""
        up = host.root / "booted"
        up.unlink(missing_ok=True)
        # unshare dies with this process, and --kill-child takes the host's init with it, and
        # so every process of the host: nothing is left of a test run that was itself killed.
        init = subprocess.Popen(
            dying_with_this_process(
                ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--pid", "--fork",
                 "--mount-proc", "--kill-child", sys.executable, "-c", INIT, host.name, str(up)]
            ),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        if not servers.wait_until(up.exists, BOOT_TIMEOUT_S, interval_s=0.05):
            raise TimeoutError(f"{host.name} did not boot within {BOOT_TIMEOUT_S:.0f} s")
        # The wrapper and `ip` exec'd into unshare, whose one child is the init.
        children = Path(f"/proc/{init.pid}/task/{init.pid}/children").read_text().split()
        (host.init,) = (int(pid) for pid in children)

    def start(self, host: Host, name: str, args: list[str], **env: str) -> subprocess.Popen:
        """A long-running process on ``host`` (logged, stopped at the end)."""
        return self.processes.start(f"{host.name}-{name}", host.command(args), host.env | env)

    def power_off(self, host: Host, timeout_s: float = 30.0, *, boot: bool = True) -> None:
        """Every process of ``host`` SIGKILLed, as a machine that loses power; with ``boot``, it
        then starts again with nothing running (its files kept), as a machine turned back on."""
        deadline = time.monotonic() + timeout_s
        host.init = 0
        while pids := host.pids():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{host.name} still runs {pids} after {timeout_s} s")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            time.sleep(0.2)
        if boot:
            self.boot(host)

    def __exit__(self, *exc: object) -> None:
        self.processes.stop()
        self._remove()

    def _remove(self) -> None:
        for host in self.hosts:
            with contextlib.suppress(TimeoutError):
                self.power_off(host, boot=False)  # no stray Ray node or worker outlives it
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
