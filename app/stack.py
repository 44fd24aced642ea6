"""``imageops serve``: the whole stack on one machine, up with one command, down with Ctrl-C.

Four processes, each in its own process group with its log under ``<home>/stack/logs``: Prefect
server (behind its auth string), MLflow server (the project's own store, webhooks on), the promotion
receiver, and a checked worker on the ``local`` pool (``app.checked_worker``), whose deployments are
registered in between. Servers bind to 127.0.0.1; the webhook secrets and the Prefect auth string
are kept under ``<home>/stack`` for restarts; ``<home>`` is owner-only (0700).
Details: docs/stack.md#the-stack-imageops-serve.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from app.deployments import DEPLOYMENTS_FILE, TRAINING_QUEUE, register_deployments
from app.mlflow_ui import server_args
from app.temporary_api import DATABASE_VARIABLES
from app.webhook import DEFAULT_PORT as RECEIVER_PORT
from app.webhook import PATH as RECEIVER_PATH
from tasks.shared import servers
from tasks.shared.database_templates import seed
from tasks.shared.errors import ImageOpsError
from tasks.shared.log_tail import read_from, tail
from tasks.shared.private_folders import private_folder
from tasks.shared.settings import Settings

POOL = "local"
PREFECT_USER = "imageops"  # the user part of the Prefect auth string
START_TIMEOUT_S = 180.0
# Then SIGKILL: services stop in 1-2 s when well, and a stop ends within 10 s (7 s took 10.4 in CI).
STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Ports:
    prefect: int = 4200
    mlflow: int = 5000
    receiver: int = RECEIVER_PORT


@dataclass
class _Service:
    name: str
    args: list[str]
    env: dict[str, str]
    process: subprocess.Popen | None = None
    log: Path | None = None
    # How to stop it, when not by SIGTERM to its group (Ray drains first; SeaweedFS is slow).
    stopper: Callable[[], None] | None = None
    user: str | None = None
    private: bool = False
    offset: int = 0  # the log's size before this start: its lines begin there
    started_at: float = 0.0  # time.monotonic() of this start


def kept_secret(path: Path, make: Callable[[], str]) -> str:
    """A secret made once and kept in ``path`` (owner-only), so restarts agree with storage.

    A kept file that others may read is made owner-only again before it is used.
    """
    if path.is_file():
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    value = make()
    temporary = path.with_suffix(".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(value)
    temporary.replace(path)
    return value


class Services:
    """Processes started in order, watched, and stopped last started first, logs in ``dir``.

    What ``imageops serve``, ``imageops team server`` and ``imageops team join`` share.
    """

    command = "imageops serve"  # what to run again, in an error message

    def __init__(self, directory: Path, cwd: Path) -> None:
        self.dir, self.cwd = directory, cwd
        self.services: list[_Service] = []
        # Process groups of restarted services, whose other processes ran on (``restart``).
        self.left_behind: list[int] = []

    def _launch(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        *,
        user: str | None = None,
        private: bool = False,
        stopper: Callable[[subprocess.Popen], None] | None = None,
    ) -> _Service:
        log = self.dir / "logs" / f"{name}.log"
        service = _Service(name, args, env, log=log, user=user, private=private)
        self._start(service)
        if stopper is not None:
            service.stopper = lambda: stopper(service.process)
        self.services.append(service)
        return service

    def _start(self, service: _Service) -> None:
        assert service.log is not None
        service.offset = service.log.stat().st_size if service.log.is_file() else 0
        service.started_at = time.monotonic()
        # In a group of its own: Ctrl-C reaches us, and we stop them in order.
        service.process = servers.start(
            service.args, service.log, service.env, cwd=self.cwd, user=service.user,
            private=service.private,
        )  # fmt: skip

    def restart(self, service: _Service, *, keep_group: bool) -> None:
        """Start an exited service again, its log appended to (``output`` reads the new lines).

        ``keep_group``: what is left of its process group runs on (a Prefect worker's flow
        runs, which outlive it), and is stopped with the rest by ``stop``; else it is stopped
        first (a Ray node's leftovers would hold its ports).
        """
        assert service.process is not None and service.process.poll() is not None
        if keep_group:
            self.left_behind = [g for g in self.left_behind if servers.group_alive(g)]
            self.left_behind.append(service.process.pid)
        else:
            servers.stop_together([], STOP_TIMEOUT_S, groups=[service.process.pid])
        self._start(service)

    def output(self, service: _Service) -> str:
        """What the service wrote since its last start: never an earlier start's lines."""
        return read_from(service.log, service.offset) if service.log is not None else ""

    def check_alive(self) -> None:
        """Raise, with the end of what it wrote, if a service has exited."""
        for service in self.services:
            if service.process is not None and service.process.poll() is not None:
                lines = tail(service.log, offset=service.offset) or "(empty)"
                raise ImageOpsError(
                    f"{service.name} exited with code {service.process.returncode}. "
                    f"End of {service.log}:\n{lines}",
                    f"Fix what its log says, then run `{self.command}` again.",
                )

    def serve_forever(self, poll_s: float = 1.0) -> None:
        """Block until Ctrl-C (or SIGTERM), or until ``watch`` raises."""
        with servers.stop_signals():
            while True:
                self.watch()
                time.sleep(poll_s)

    def watch(self) -> None:
        """One look at the services: here a dead one ends the stack (``team join`` restarts it)."""
        self.check_alive()

    def stop(self) -> str:
        """Stop every service: those with a stopper of their own (a database, a Ray node: they
        drain first) one by one, last started first; the others together, so that Ctrl-C on
        `imageops serve` ends within one timeout (``STOP_TIMEOUT_S``), not one per service.

        Returns what the command says at its end: how long the stop took, and the services
        SIGKILLed for not stopping in time (a slow stop's cause, where the person looks)."""
        began = time.monotonic()
        together = []
        for service in reversed(self.services):
            if service.stopper is not None:
                service.stopper()
            elif service.process is not None:
                together.append(service)
        killed = servers.stop_together(
            [service.process for service in together if service.process is not None],
            STOP_TIMEOUT_S,
            groups=self.left_behind,
        )
        names = [s.name for s in together if s.process is not None and s.process.pid in killed]
        names += ["a restarted service's processes"] * any(g in killed for g in self.left_behind)
        self.services.clear()
        self.left_behind.clear()
        line = f"stopped in {time.monotonic() - began:.1f} s"
        if names:
            line += f" ({', '.join(names)}: SIGKILL after {STOP_TIMEOUT_S:.0f} s without stopping)"
        return line


def stop_leader_first(process: subprocess.Popen, sig: signal.Signals, timeout_s: float) -> None:
    """Signal the group's leader alone and wait; then stop the whole group as usual.

    For servers that stop their own children in order (``ray start --block`` drains its node
    first; PostgreSQL's SIGINT is its fast shutdown): a signal to the whole group would cut that.
    """
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout_s)
    servers.stop(process, STOP_TIMEOUT_S)  # what is left of its group


class Stack(Services):
    """The local stack; ``start`` brings it up, ``stop`` takes it down (last started, first)."""

    def __init__(
        self,
        settings: Settings,
        *,
        host: str = "127.0.0.1",
        ports: Ports = Ports(),
        ui: bool = True,
        worker: bool = True,
        say: Callable[[str], None] = print,
    ) -> None:
        self.settings, self.host, self.ports = settings, host, ports
        self.ui, self.worker, self.say = ui, worker, say
        super().__init__(settings.home_dir / "stack", settings.project_root)
        # Clients reach the servers on loopback when they listen everywhere.
        reach = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.prefect_url = f"http://{reach}:{ports.prefect}"
        self.prefect_api = f"{self.prefect_url}/api"
        self.mlflow_url = f"http://{reach}:{ports.mlflow}"
        self.receiver_url = f"http://{reach}:{ports.receiver}{RECEIVER_PATH}"

    # --- environment -----------------------------------------------------------------------

    def prefect_auth_string(self) -> str:
        """The Prefect API's login (``user:password``), kept owner-only for restarts and for
        imageops' own commands (``Settings.prefect_auth_file``)."""
        return kept_secret(
            self.settings.prefect_auth_file, lambda: f"{PREFECT_USER}:{secrets.token_urlsafe(32)}"
        )

    def client_environment(self) -> dict[str, str]:
        """What a process needs to use this stack (the worker's flow runs get the same).

        The rest of this environment passes through, so Prefect's own settings (e.g.
        PREFECT_WORKER_QUERY_SECONDS) reach the worker as a person exported them.
        """
        settings = Settings(
            project_root=self.settings.project_root,
            home=self.settings.home_dir,
            mlflow_tracking_uri=self.mlflow_url,
            prefect_api_url=self.prefect_api,
            registered_model_name=self.settings.registered_model_name,
            mlflow_experiment=self.settings.mlflow_experiment,
        )
        env = dict(os.environ) | settings.environment()
        env |= {
            "IMAGEOPS_MLFLOW_TRACKING_URI": self.mlflow_url,
            "IMAGEOPS_PREFECT_API_URL": self.prefect_api,
            "IMAGEOPS_REGISTERED_MODEL_NAME": self.settings.registered_model_name,
            "IMAGEOPS_MLFLOW_EXPERIMENT": self.settings.mlflow_experiment,
            "PREFECT_API_URL": self.prefect_api,
            "PREFECT_API_AUTH_STRING": self.prefect_auth_string(),
            "PREFECT_HOME": str(self.dir / "prefect-client"),
        }
        if self.settings.tuning_storage:
            env["IMAGEOPS_TUNING_STORAGE"] = self.settings.tuning_storage
        return env

    # --- start and stop ------------------------------------------------------------------

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start everything and wait until it answers; on any failure stop what started."""
        busy = [
            f"{name} port {port}"
            for name, port in (
                ("Prefect", self.ports.prefect),
                ("MLflow", self.ports.mlflow),
                ("receiver", self.ports.receiver),
            )
            if not servers.port_free(self.host, port)
        ]
        if busy:
            raise ImageOpsError(
                f"Cannot serve: {', '.join(busy)} on {self.host} is in use.",
                "Stop the other server (another `imageops serve`?) or choose other ports "
                "(--prefect-port, --mlflow-port, --receiver-port).",
            )
        # Owner-only before any server starts: nothing they keep below is open to other users.
        private_folder(self.settings.home_dir)
        private_folder(self.dir)
        secret = (
            self.settings.webhook_secret.get_secret_value()
            if self.settings.webhook_secret
            else kept_secret(self.dir / "webhook-secret", lambda: secrets.token_urlsafe(32))
        )
        try:
            self._start_servers(secret)
            self._wait(timeout_s)
            self.say("servers up; creating the work pool and registering the deployments")
            self._create_pool()
            self._create_automations()
            self._register(secret)
            if self.worker:
                self._launch(
                    "worker",
                    [sys.executable, "-m", "app.checked_worker", "--pool", POOL,
                     "--name", f"imageops-{POOL}-worker"],
                    self.client_environment(),
                )  # fmt: skip
        except BaseException:
            self.stop()
            raise

    def _start_servers(self, secret: str) -> None:
        from cryptography.fernet import Fernet

        home = self.settings.home_dir
        quiet = {
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "DO_NOT_TRACK": "1",
        }
        # Servers get this environment (a person's PREFECT_SERVER_* or database settings pass
        # through) without client settings that would point them elsewhere.
        base = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")
        }
        prefect_args = [_tool("prefect"), "server", "start", "--host", self.host,
                        "--port", str(self.ports.prefect)]  # fmt: skip
        if not self.ui:
            prefect_args.append("--no-ui")
        # One Prefect history per project: the server keeps its SQLite database where `imageops
        # run`'s temporary API keeps it (PREFECT_HOME of the project's commands), so the runs
        # made before the stack came up show in its UI, artifacts and all (issue 47). New
        # databases start from the migrated templates: seconds of migrations saved.
        prefect_home = self.settings.home_dir / "prefect"
        if not any(base.get(name) for name in DATABASE_VARIABLES):  # else not SQLite's file
            seed("prefect", prefect_home / "prefect.db")
        seed("mlflow", home / "mlflow.db")
        self._launch(
            "prefect-server",
            prefect_args,
            # The UI calls the API where this stack put it, not on Prefect's default port.
            {"PREFECT_UI_API_URL": self.prefect_api}
            | base
            | quiet
            | {
                "PREFECT_HOME": str(prefect_home),
                # No request without it but /api/health and /api/ready (the UI asks for it).
                "PREFECT_SERVER_API_AUTH_STRING": self.prefect_auth_string(),
            },
            private=True,
        )
        key = kept_secret(self.dir / "mlflow-webhook-key", lambda: Fernet.generate_key().decode())
        self._launch(
            "mlflow-server",
            [_tool("mlflow"), "server", *server_args(), "--host", self.host, "--port",
             str(self.ports.mlflow), "--workers", "1", "--backend-store-uri",
             f"sqlite:///{home / 'mlflow.db'}", "--artifacts-destination", f"{home}/mlartifacts"],
            base | quiet | {
                # The receiver is on http://127.0.0.1: MLflow's SSRF guard refuses it otherwise.
                "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https",
                "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
                # One key for the stored webhook secrets, the same after a restart.
                "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY": key,
                "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            },
            private=True,
        )  # fmt: skip
        self._launch(
            "receiver",
            [sys.executable, "-m", "app.webhook", "serve", "--host", self.host,
             "--port", str(self.ports.receiver)],
            self.client_environment() | {"IMAGEOPS_WEBHOOK_SECRET": secret},
        )  # fmt: skip

    def _wait(self, timeout_s: float) -> None:
        checks = {
            "Prefect server": f"{self.prefect_api}/health",
            "MLflow server": f"{self.mlflow_url}/health",
            "promotion receiver": self.receiver_url.removesuffix(RECEIVER_PATH) + "/health",
        }
        deadline = time.monotonic() + timeout_s
        for what, url in checks.items():
            left = deadline - time.monotonic()
            if not servers.wait_until(
                lambda url=url: self.check_alive() or servers.healthy(url), left, interval_s=0.5
            ):
                raise ImageOpsError(
                    f"The {what} did not answer at {url} within {timeout_s:.0f} s.",
                    f"Read its log in {self.dir / 'logs'}.",
                )

    def prefect_client_settings(self) -> dict:
        """Prefect client settings (for ``temporary_settings``) that reach this stack's API."""
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL

        return {
            PREFECT_API_URL: self.prefect_api,
            PREFECT_API_AUTH_STRING: self.prefect_auth_string(),
        }

    def _create_pool(self, pool: str = POOL) -> None:
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound
        from prefect.settings import temporary_settings

        from app.work_pools import work_pool_create

        with (
            temporary_settings(updates=self.prefect_client_settings()),
            get_client(sync_client=True) as client,
        ):
            client.create_work_pool(work_pool_create(pool), overwrite=True)
            try:
                queue = client.read_work_queue_by_name(TRAINING_QUEUE, work_pool_name=pool)
            except ObjectNotFound:
                client.create_work_queue(
                    name=TRAINING_QUEUE,
                    work_pool_name=pool,
                    concurrency_limit=1,
                    description="One training at a time on this pool.",
                )
            else:  # someone may have changed it; the limit is what makes it the training queue
                client.request(
                    "PATCH", "/work_queues/{id}", path_params={"id": queue.id},
                    json={"concurrency_limit": 1},
                )  # fmt: skip

    def _create_automations(self) -> None:
        """Flow runs gone with no worker to see it end Crashed or Cancelled (app.lost_flow_runs)."""
        from prefect.client.orchestration import get_client
        from prefect.settings import temporary_settings

        from app.lost_flow_runs import ensure_automations

        with (
            temporary_settings(updates=self.prefect_client_settings()),
            get_client(sync_client=True) as client,
        ):
            ensure_automations(client)

    def mlflow_login(self) -> dict[str, str]:
        """The variables that log MLflow's client in to this stack's server (none here)."""
        return {}

    @contextlib.contextmanager
    def _clients(self) -> Iterator[tuple[object, object]]:
        """An MLflow client and a sync Prefect client of this stack's servers."""
        from mlflow import MlflowClient
        from prefect.client.orchestration import get_client
        from prefect.settings import temporary_settings

        with (
            temporary_settings(updates=self.prefect_client_settings()),
            get_client(sync_client=True) as prefect,
        ):
            yield MlflowClient(self.mlflow_url, self.mlflow_url), prefect

    def serve_forever(self, poll_s: float = 1.0) -> None:
        """Block until Ctrl-C (or SIGTERM), or until a service dies; meanwhile end the MLflow
        runs their flow runs left RUNNING (app.stranded_runs)."""
        from app.stranded_runs import keep_ending_stranded_runs

        os.environ.update(self.mlflow_login())  # MLflow's client reads its login from there
        stop = threading.Event()
        keep_ending_stranded_runs(self._clients, self.say, stop)
        try:
            super().serve_forever(poll_s)
        finally:
            stop.set()

    def _register(self, secret: str) -> None:
        from app.webhook import register_webhook

        self._register_deployments()
        register_webhook(self.receiver_url, secret=secret, mlflow_url=self.mlflow_url)

    def _register_deployments(self) -> None:
        from prefect.settings import temporary_settings

        with temporary_settings(updates=self.prefect_client_settings()):
            register_deployments(DEPLOYMENTS_FILE, work_pool=POOL)

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def _tool(name: str) -> str:
    """A console script of this environment (prefect, mlflow), wherever the shell's PATH points."""
    here = Path(sys.executable).parent / name
    return str(here) if here.is_file() else name
