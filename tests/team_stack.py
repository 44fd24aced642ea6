"""The team stack as docs/team.md runs it, for tests with namespace hosts (tests/hosts.py).

``imageops team server --host <the bridge's address>`` in the root namespace, from a project
folder of its own; on each host, the join file copied where the docs put it (the host user's
``~/.config/imageops/team.env``, mode 0600) and ``imageops team join`` from its checkout. The
test process talks to the servers with the join file's logins, as a person who sourced it would.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
from hosts import Host, Hosts
from server_processes import LONG_WAIT, PROMPT_WORKER, RAY_NODE, base_env

from app.team_join import read_join_file
from tasks.shared import servers

PY = sys.executable
START_TIMEOUT_S = 300.0  # the team server brought up in 20-50 s, 140 s on a busy 2-core machine
JOIN_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 90.0
# A Ray node that stops answering is declared dead in about 3 s, not Ray's default 15 s+ (the
# head's setting: the team server passes its environment on to the Ray head).
QUICK_RAY_HEALTH = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
# Prefect's scheduler makes a new schedule's runs within 5 s, not its default 60 s (a person's
# PREFECT_SERVER_* setting: the team server passes its environment on to the Prefect server).
PROMPT_SCHEDULER = {"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5"}


class TeamStack:
    """One ``imageops team server`` on ``hosts``' bridge, and the hosts' ``team join``."""

    def __init__(self, hosts: Hosts) -> None:
        self.hosts = hosts
        # Not under pytest's tmp_path: PostgreSQL runs as `postgres` when we are root, and must
        # enter the project folder.
        self.folder = Path(tempfile.mkdtemp(prefix="imageops-team-"))
        self.folder.chmod(0o755)
        self.log = hosts.processes.logs / "team-server.log"
        self.server: subprocess.Popen | None = None
        self.values: dict[str, str] = {}
        self.joins: dict[str, subprocess.Popen] = {}
        self.join_logs: dict[str, Path] = {}  # each host's last join's log
        self.join_count = 0

    def start(self) -> None:
        """`imageops team server --host <bridge>` until it says ready; its join file read."""
        env = base_env() | RAY_NODE | QUICK_RAY_HEALTH | PROMPT_SCHEDULER
        command = [PY, "-m", "app.cli", "team", "server", "--host", self.hosts.gateway]
        self.server = servers.start(command, self.log, env, cwd=self.folder)
        self.wait_for_log(self.log, "ready;", START_TIMEOUT_S)
        self.values = read_join_file(self.folder / ".imageops" / "team" / "team.env")

    def join(self, *hosts: Host, **env: str) -> None:
        """`imageops team join` on each of ``hosts`` at once (``env`` added to its
        environment), until each says joined."""
        for host in hosts:
            join_file = host.home / ".config" / "imageops" / "team.env"
            if not join_file.exists():  # the docs' `mkdir`, `scp` and `chmod 600`
                join_file.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(self.folder / ".imageops" / "team" / "team.env", join_file)
                join_file.chmod(0o600)
            self.join_count += 1  # each join's log a file of its own
            name = f"join-{self.join_count}"
            command = [PY, "-m", "app.cli", "team", "join"]
            # Prefect's own setting passes through the join to its worker.
            proc = self.hosts.start(host, name, command, **PROMPT_WORKER | RAY_NODE | env)
            self.joins[host.name] = proc
            self.join_logs[host.name] = self.hosts.processes.logs / f"{host.name}-{name}.log"
        for host in hosts:
            log, proc = self.join_logs[host.name], self.joins[host.name]
            self.wait_for_log(log, "joined;", JOIN_TIMEOUT_S, proc)

    def leave(self, host: Host) -> None:
        """Ctrl-C to ``host``'s `team join`, as a person leaves the team; waits for its end."""
        proc = self.joins.pop(host.name)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(STOP_TIMEOUT_S)

    def wait_for_log(
        self, log: Path, line: str, timeout_s: float, proc: subprocess.Popen | None = None
    ) -> None:
        """Until ``log`` has ``line``; fails with every log if ``proc`` (or the server) ends."""

        def said() -> bool:
            for command in (self.server, proc):
                if command is not None and command.poll() is not None:
                    raise AssertionError(
                        f"{command.args[3:6]} exited ({command.returncode}) before "
                        f"{line!r}\n{self.report()}"
                    )
            return log.is_file() and line in log.read_text(errors="replace")

        if not servers.wait_until(said, timeout_s, **LONG_WAIT):
            raise AssertionError(f"no {line!r} in {log} after {timeout_s:.0f} s\n{self.report()}")

    def prefect(self) -> httpx.Client:
        """A client of the Prefect API with the join file's auth string."""
        user, _, password = self.values["PREFECT_API_AUTH_STRING"].partition(":")
        return httpx.Client(
            base_url=self.values["PREFECT_API_URL"], auth=(user, password), timeout=30
        )

    @contextlib.contextmanager
    def logged_in(self) -> Iterator[None]:
        """This process's environment with the join file's variables (MLflow's client, boto3)."""
        saved = dict(os.environ)
        os.environ.update(self.values)
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def report(self) -> str:
        """The end of the team server's, every join's and every service's log."""
        logs = [self.log, *self.join_logs.values()]
        logs += sorted((self.folder / ".imageops" / "team" / "logs").glob("*.log"))
        for host in self.hosts.hosts:
            logs += sorted((host.project / ".imageops" / "team-join" / "logs").glob("*.log"))
        return "\n".join(
            f"----- {p} -----\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.is_file()
        )

    def stop(self) -> None:
        """SIGTERM to the server (it stops every service), SIGKILL to what is left past the
        timeout; its folder removed (and Ray's session folders it links to)."""
        if self.server is not None and self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGTERM)
            try:
                self.server.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait()
        link = self.folder / ".imageops" / "team" / "ray"
        if link.is_symlink():  # Ray's short session folder (app.team.ray_temp_dir)
            shutil.rmtree(link.resolve(), ignore_errors=True)
        for host in self.hosts.hosts:
            link = host.project / ".imageops" / "team-join" / "ray"
            if link.is_symlink():
                shutil.rmtree(link.resolve(), ignore_errors=True)
        shutil.rmtree(self.folder, ignore_errors=True)
