"""``imageops team``: the shared services of a team on several machines, each behind a login.

``imageops team server`` runs, on one machine: PostgreSQL (Prefect's and MLflow's databases),
SeaweedFS S3 (DVC remote, MLflow artifacts, checkpoints), MLflow's basic-auth app, the Prefect
server with its auth string, and a Ray head. ``imageops team join`` runs, on each GPU machine, a Ray
worker node and a Prefect worker with the variables of the server's join file. Every secret is made
once with :mod:`secrets` and kept owner-only under ``<home>/team/secrets``, so a restart reuses it.
Details: docs/stack.md#the-team-stack-imageops-team.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pwd
import secrets
import shlex
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.mlflow_ui import server_args
from app.stack import (
    PREFECT_USER,
    Ports,
    Stack,
    _Service,
    _tool,
    kept_secret,
    stop_leader_first,
)
from app.team_postgres import TeamPostgres, _write_private, postgres_user
from app.work_pools import POOLS
from tasks.shared import servers
from tasks.shared.errors import (
    TeamAuthError,
    TeamStackError,
    TeamUnreachableError,
)
from tasks.shared.log_tail import tail
from tasks.shared.private_folders import private_folder, private_tree
from tasks.shared.settings import Settings

if TYPE_CHECKING:
    from tasks.shared.object_store import S3Server

TEAM_DIR = "team"  # <home>/team on the server machine
POSTGRES_DIR = "postgres"  # <home>/team/postgres: PostgreSQL's data folder
JOIN_DIR = "team-join"  # <home>/team-join on a GPU machine
JOIN_FILE = "team.env"
BUCKET = "imageops"
MLFLOW_ADMIN = "admin"
MLFLOW_LOGIN_CACHE_S = 600  # how long the MLflow server trusts a login it checked
START_TIMEOUT_S = 300.0  # a busy 2-core machine took 140 s to bring all five up
RAY_STOP_TIMEOUT_S = 40.0  # `ray start --block` drains its node for up to 30 s on SIGTERM
POSTGRES_STOP_TIMEOUT_S = 20.0
CHECK_TIMEOUT_S = 10.0
RAY_TEMP_DIR_MAX = 40  # + Ray's session and socket names stays within a unix socket's 107 bytes
RAY_TEMP_NAME = "temp"  # Ray's --temp-dir, in an owner-only folder (Ray makes it 0777)
_QUIET = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
}

# Every variable of the join file, and what it is: docs/team.md lists the same, one line each.
JOIN_VARIABLES: dict[str, str] = {
    "IMAGEOPS_PREFECT_API_URL": "the Prefect server's API, http://SERVER:4200/api",
    "PREFECT_API_URL": "the same, for the `prefect` command and Prefect's client",
    "PREFECT_API_AUTH_STRING": "the Prefect API's login (user:password); without it: 401",
    "IMAGEOPS_MLFLOW_TRACKING_URI": "the MLflow server (tracking and registry), http://SERVER:5000",
    "MLFLOW_TRACKING_USERNAME": "MLflow's basic-auth user (admin)",
    "MLFLOW_TRACKING_PASSWORD": "its password",
    "IMAGEOPS_DVC_REMOTE_URL": "the DVC remote, s3://imageops/dvc",
    "IMAGEOPS_CHECKPOINT_URL": "where training checkpoints go, s3://imageops/checkpoints",
    "IMAGEOPS_S3_ENDPOINT_URL": "the S3 server (SeaweedFS), http://SERVER:8333",
    "AWS_ENDPOINT_URL": "the same, for boto3, DVC and the aws command",
    "MLFLOW_S3_ENDPOINT_URL": "the same, for MLflow's S3 client",
    "AWS_ACCESS_KEY_ID": "the S3 access key",
    "AWS_SECRET_ACCESS_KEY": "the S3 secret key",
    "AWS_DEFAULT_REGION": "the region S3 requests are signed for (us-east-1)",
    "IMAGEOPS_RAY_ADDRESS": "the Ray head, SERVER:6379: the `cluster` (--cluster) of a training, "
    "and where a promotion's scoring runs",
    "RAY_AUTH_MODE": "token: the Ray cluster takes only callers that hold its token",
    "RAY_AUTH_TOKEN": "the Ray cluster's token",
}


@dataclass(frozen=True)
class TeamPorts:
    """The ports of the server machine's services (Ray's GCS; Ray opens more, see the docs)."""

    prefect: int = 4200
    mlflow: int = 5000
    s3: int = 8333
    postgres: int = 5432
    ray: int = 6379


def ray_temp_dir(folder: Path) -> Path:
    """Where a Ray node keeps its sessions: ``temp`` in ``folder`` or in the folder it links to.

    Ray makes that folder and its sessions 0777 (sockets, logs, runtime resources): the folder
    it is in is owner-only (0700), so no other user reaches them. Ray puts unix sockets under it
    (``session_<time>_<pid>/sockets/plasma_store``), whose paths may not exceed 107 bytes: a
    deep project folder gets a short one under the system's temp folder, named after ``folder``
    (refused when another user made it first), and ``folder`` becomes a link to it.
    """
    if len(str(folder / RAY_TEMP_NAME)) <= RAY_TEMP_DIR_MAX:
        return private_folder(folder) / RAY_TEMP_NAME
    digest = hashlib.sha256(str(folder).encode()).hexdigest()[:12]
    short = private_folder(Path(tempfile.gettempdir()) / f"imageops-ray-{digest}")
    if folder.is_symlink() or not folder.exists():
        folder.unlink(missing_ok=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
        folder.symlink_to(short, target_is_directory=True)
    return short / RAY_TEMP_NAME


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class TeamServer(Stack):
    """The server machine's services; ``start`` brings them up, ``stop`` takes them down."""

    command = "imageops team server"

    def __init__(
        self,
        settings: Settings,
        *,
        host: str = "127.0.0.1",
        ports: TeamPorts = TeamPorts(),
        ui: bool = True,
        say: Callable[[str], None] = print,
    ) -> None:
        if host in ("", "0.0.0.0", "::"):
            raise TeamStackError(
                f"--host {host!r} is not an address other machines can reach: the join file "
                "gives it to every GPU machine.",
                "Give the server machine's address on the network the GPU machines share, "
                "e.g. --host 10.0.0.5 (or 127.0.0.1 for one machine).",
            )
        super().__init__(
            settings, host=host, ports=Ports(prefect=ports.prefect, mlflow=ports.mlflow), ui=ui,
            worker=False, say=say,
        )  # fmt: skip
        self.dir = settings.home_dir / TEAM_DIR
        self.team_ports = ports
        self.secrets_dir = self.dir / "secrets"
        self.join_file = self.dir / JOIN_FILE
        self.postgres: TeamPostgres | None = None
        self.s3: S3Server | None = None
        self.s3_url = f"http://{_url_host(host)}:{ports.s3}"
        self.ray_address = f"{_url_host(host)}:{ports.ray}"

    # --- secrets -----------------------------------------------------------------------------

    def secret(self, name: str, make: Callable[[], str] | None = None) -> str:
        """The kept secret ``name`` (a file of mode 0600 in ``secrets/``), made on first use."""
        self.secrets_dir.mkdir(parents=True, exist_ok=True)
        self.secrets_dir.chmod(0o700)
        return kept_secret(self.secrets_dir / name, make or (lambda: secrets.token_urlsafe(32)))

    def previous_secret(self, name: str) -> str | None:
        """The secret ``name`` had before a rotation (``NAME.old``), if one is under way."""
        old = self.secrets_dir / f"{name}.old"
        return old.read_text().strip() if old.is_file() else None

    def prefect_auth_string(self) -> str:
        return self.secret(
            "prefect-auth-string", lambda: f"{PREFECT_USER}:{secrets.token_urlsafe(32)}"
        )

    def mlflow_login(self) -> dict[str, str]:
        return {
            "MLFLOW_TRACKING_USERNAME": MLFLOW_ADMIN,
            "MLFLOW_TRACKING_PASSWORD": self.secret("mlflow-admin-password"),
        }

    def s3_keys(self) -> tuple[str, str]:
        return (
            self.secret("s3-access-key", lambda: secrets.token_hex(10).upper()),
            self.secret("s3-secret-key", lambda: secrets.token_urlsafe(30)),
        )

    def join_variables(self) -> dict[str, str]:
        """Every variable a GPU machine needs: what ``team.env`` holds (JOIN_VARIABLES)."""
        access, secret = self.s3_keys()
        values = {
            "IMAGEOPS_PREFECT_API_URL": self.prefect_api,
            "PREFECT_API_URL": self.prefect_api,
            "PREFECT_API_AUTH_STRING": self.prefect_auth_string(),
            "IMAGEOPS_MLFLOW_TRACKING_URI": self.mlflow_url,
            "MLFLOW_TRACKING_USERNAME": MLFLOW_ADMIN,
            "MLFLOW_TRACKING_PASSWORD": self.secret("mlflow-admin-password"),
            "IMAGEOPS_DVC_REMOTE_URL": f"s3://{BUCKET}/dvc",
            "IMAGEOPS_CHECKPOINT_URL": f"s3://{BUCKET}/checkpoints",
            "IMAGEOPS_S3_ENDPOINT_URL": self.s3_url,
            "AWS_ENDPOINT_URL": self.s3_url,
            "MLFLOW_S3_ENDPOINT_URL": self.s3_url,
            "AWS_ACCESS_KEY_ID": access,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": "us-east-1",
            "IMAGEOPS_RAY_ADDRESS": self.ray_address,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.secret("ray-auth-token", lambda: secrets.token_hex(32)),
        }
        assert list(values) == list(JOIN_VARIABLES)
        return values

    # --- start and stop ------------------------------------------------------------------

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start every service and wait until it answers; on any failure stop what started."""
        if importlib.util.find_spec("flask_wtf") is None:
            raise TeamStackError(
                "MLflow's basic-auth app needs the Flask-WTF package, which is not installed.",
                "Install the project's lock (`make install`; it has mlflow[auth]), or "
                "`pip install 'mlflow[auth]==3.17.2'`.",
            )
        ports = self.team_ports
        busy = [
            f"{name} port {port}"
            for name, port in (
                ("PostgreSQL", ports.postgres), ("S3", ports.s3), ("MLflow", ports.mlflow),
                ("Prefect", ports.prefect), ("Ray", ports.ray),
            )
            if not servers.port_free(self.host, port)
        ]  # fmt: skip
        if busy:
            raise TeamStackError(
                f"Cannot start the team stack: {', '.join(busy)} on {self.host} is in use.",
                "Stop the other server (another `imageops team server`?) or choose other ports "
                "(--postgres-port, --s3-port, --mlflow-port, --prefect-port, --ray-port).",
            )
        self._private_state()
        deadline = time.monotonic() + timeout_s
        try:
            postgres = self._start_postgres()
            self._start_s3()  # SeaweedFS takes a few seconds: PostgreSQL starts meanwhile
            postgres.wait(
                self.check_alive, max(deadline - time.monotonic(), 1.0),
                previous=self.previous_secret("postgres-password"),
            )  # fmt: skip
            postgres.create_databases()
            self._start_mlflow()
            self._start_prefect()
            self._start_ray()
            self._wait(max(deadline - time.monotonic(), 1.0))
            self._check_mlflow_admin()
            self.say("servers up; creating the work pools and registering the deployments")
            for pool in POOLS:
                self._create_pool(pool)
            self._create_automations()
            self._register_deployments()
            _write_private(self.join_file, self._join_file_text())
            for old in self.secrets_dir.glob("*.old"):  # rotated: the new ones are in use
                old.unlink()
        except BaseException:
            self.stop()
            raise

    def _private_state(self) -> None:
        """The project's and the team's folders owner-only before any server starts, and the
        servers' own folders in them; as root, PostgreSQL's account (it refuses root) may pass
        through both to its data folder, and reaches nothing else."""
        user = postgres_user()
        group = pwd.getpwnam(user).pw_gid if user is not None else None
        home = self.settings.home_dir
        private_tree(home, passage=self.dir / POSTGRES_DIR, group=group)
        private_folder(self.dir, group=group)
        for name in ("logs", "s3", "prefect"):
            private_folder(self.dir / name)

    def _server_environment(self) -> dict[str, str]:
        """This environment without client settings that would point a server elsewhere."""
        clients = ("PREFECT_API_", "MLFLOW_TRACKING_", "MLFLOW_REGISTRY_", "RAY_ADDRESS")
        return {k: v for k, v in os.environ.items() if not k.startswith(clients)} | _QUIET

    def _start_postgres(self) -> TeamPostgres:
        """Start PostgreSQL (made on the first start); set up once it answers."""
        self.postgres = TeamPostgres(
            self.dir / POSTGRES_DIR, host=self.host, port=self.team_ports.postgres,
            superuser_password=self.secret("postgres-password"),
            role_password=self.secret("postgres-imageops-password"),
            log=self.dir / "logs" / "postgres.log",
        )  # fmt: skip
        self._launch(
            "postgres",
            self.postgres.prepare(),
            self._server_environment() | {"LC_ALL": "C"},
            user=self.postgres.user,
            stopper=lambda p: stop_leader_first(p, signal.SIGINT, POSTGRES_STOP_TIMEOUT_S),
        )
        return self.postgres

    # S3, MLflow, Prefect, Ray

    def _start_s3(self) -> None:
        from tasks.shared.object_store import ensure_bucket, start_seaweedfs

        access, secret = self.s3_keys()
        log = self.dir / "logs" / "seaweedfs.log"
        self.s3 = start_seaweedfs(
            self.dir / "s3", host=self.host, port=self.team_ports.s3, access_key=access,
            secret_key=secret, log=log,
        )  # fmt: skip
        self.services.append(_Service("seaweedfs", [], {}, log=log, stopper=self.s3.stop))
        ensure_bucket(self.s3.endpoint_url, BUCKET, access, secret)

    def _start_mlflow(self) -> None:
        auth_ini = _write_private(
            self.dir / "mlflow-auth.ini",
            "[mlflow]\n"
            "default_permission = READ\n"
            f"database_uri = {self.postgres.url('mlflow_auth', 'postgresql+psycopg')}\n"
            f"admin_username = {MLFLOW_ADMIN}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
            # A checked login is remembered for 10 minutes (MLflow forgets it at once when the
            # user changes): each check is a scrypt hash, 0.11 CPU-seconds on a 2-core VM, and
            # the clients send the password with every request (a training's metric calls
            # kept a third of a core busy in the MLflow server).
            f"auth_cache_ttl_seconds = {MLFLOW_LOGIN_CACHE_S}\n",
        )
        assert self.s3 is not None and self.postgres is not None
        port = self.ports.mlflow
        hosts = [self.host, f"{self.host}:{port}", "localhost", f"localhost:{port}"]
        self._launch(
            "mlflow-server",
            [_tool("mlflow"), "server", *server_args(logins=True), "--host", self.host,
             "--port", str(port), "--workers", "1",
             "--artifacts-destination", f"s3://{BUCKET}/mlartifacts", "--serve-artifacts",
             "--allowed-hosts", ",".join(dict.fromkeys(hosts))],
            self._server_environment() | self.s3.environment() | {
                "MLFLOW_AUTH_CONFIG_PATH": str(auth_ini),
                # In the environment: a command line (and so its password) is public in `ps`.
                "MLFLOW_BACKEND_STORE_URI": self.postgres.url("mlflow", "postgresql+psycopg"),
                # Used only while the admin user does not exist yet (the first start).
                "MLFLOW_AUTH_ADMIN_PASSWORD": self.secret("mlflow-admin-password"),
                "MLFLOW_FLASK_SERVER_SECRET_KEY": self.secret("mlflow-flask-secret-key"),
                "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            },
            private=True,
        )  # fmt: skip

    def _start_prefect(self) -> None:
        assert self.postgres is not None
        args = [_tool("prefect"), "server", "start", "--host", self.host,
                "--port", str(self.ports.prefect)]  # fmt: skip
        if not self.ui:
            args.append("--no-ui")
        self._launch(
            "prefect-server",
            args,
            self._server_environment() | {
                "PREFECT_HOME": str(self.dir / "prefect"),
                "PREFECT_UI_API_URL": self.prefect_api,
                "PREFECT_API_DATABASE_CONNECTION_URL": self.postgres.url(
                    "prefect", "postgresql+asyncpg"
                ),
                "PREFECT_SERVER_API_AUTH_STRING": self.prefect_auth_string(),
            },
            private=True,
        )  # fmt: skip

    def _start_ray(self) -> None:
        self._launch(
            "ray-head",
            [_tool("ray"), "start", "--head", "--node-ip-address", self.host,
             "--port", str(self.team_ports.ray), "--num-cpus", "0", "--num-gpus", "0",
             "--disable-usage-stats", "--include-dashboard=false",
             "--temp-dir", str(ray_temp_dir(self.dir / "ray")), "--block"],
            self._server_environment() | {
                "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": self.secret("ray-auth-token", lambda: secrets.token_hex(32)),
            },
            private=True,
            stopper=lambda p: stop_leader_first(p, signal.SIGTERM, RAY_STOP_TIMEOUT_S),
        )  # fmt: skip

    def _check_mlflow_admin(self) -> None:
        """MLflow's admin takes the kept password; after a rotation, set it with the old one."""
        import httpx

        password = self.secret("mlflow-admin-password")
        search = f"{self.mlflow_url}/api/2.0/mlflow/experiments/search"
        login = (MLFLOW_ADMIN, password)
        if httpx.get(search, params={"max_results": 1}, auth=login, timeout=30).status_code != 401:
            return
        previous = self.previous_secret("mlflow-admin-password")
        if previous is None:
            raise TeamAuthError(
                f"MLflow at {self.mlflow_url} refused user {MLFLOW_ADMIN} with the kept password "
                "(secrets/mlflow-admin-password): the user store holds another one.",
                "Put the old password back in that file; to rotate it, rename the old file to "
                "mlflow-admin-password.old instead and start again.",
            )
        httpx.patch(
            f"{self.mlflow_url}/api/2.0/mlflow/users/update-password",
            json={"username": MLFLOW_ADMIN, "password": password, "current_password": previous},
            auth=(MLFLOW_ADMIN, previous), timeout=30,
        ).raise_for_status()  # fmt: skip

    def _wait(self, timeout_s: float) -> None:
        checks: dict[str, Callable[[], bool]] = {
            f"MLflow server at {self.mlflow_url}": lambda: servers.healthy(
                f"{self.mlflow_url}/health"
            ),
            f"Prefect server at {self.prefect_api}": lambda: servers.healthy(
                f"{self.prefect_api}/health"
            ),
            f"Ray head at {self.ray_address}": lambda: _tcp_open(self.host, self.team_ports.ray),
        }
        deadline = time.monotonic() + timeout_s
        for what, check in checks.items():
            left = max(deadline - time.monotonic(), 0.5)
            if not servers.wait_until(
                lambda check=check: self.check_alive() or check(), left, interval_s=0.5
            ):
                raise TeamUnreachableError(
                    f"The {what} did not answer within {timeout_s:.0f} s.",
                    f"Read its log in {self.dir / 'logs'}.",
                )

    def check_alive(self) -> None:
        super().check_alive()
        if self.s3 is not None and not self.s3.running():
            raise TeamStackError(
                f"SeaweedFS (S3) exited. End of {self.s3.log}:\n{tail(self.s3.log)}",
                f"Fix what its log says, then run `{self.command}` again.",
            )

    def _join_file_text(self) -> str:
        lines = [
            "# imageops team join file: every variable a GPU machine needs (see docs/team.md,",
            "# 'A team on several machines'). It holds passwords: keep it mode 0600.",
            "# On a GPU machine it goes to ~/.config/imageops/team.env, outside the checkout:",
            "# imageops team join   (in a shell: set -a; . ~/.config/imageops/team.env; set +a)",
        ]
        lines += [f"{k}={shlex.quote(v)}" for k, v in self.join_variables().items()]
        return "\n".join(lines) + "\n"


def _tcp_open(host: str, port: int, timeout_s: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
