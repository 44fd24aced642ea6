"""``imageops team``: the shared services of a team on several machines, each behind a login.

``imageops team server`` runs, on one machine: PostgreSQL (Prefect's and MLflow's databases),
SeaweedFS S3 (DVC remote, MLflow artifacts, checkpoints), MLflow's basic-auth app, the Prefect
server with its auth string, and a Ray head. ``imageops team join`` runs, on each GPU machine, a Ray
worker node and a Prefect worker with the variables of the server's join file. Every secret is made
once with :mod:`secrets` and kept owner-only under ``<home>/team/secrets``, so a restart reuses it.
Details: docs/stack.md#the-team-stack-imageops-team.
"""

from __future__ import annotations

import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.stack import Ports, Services, Stack, _Service, _tool, kept_secret, stop_leader_first
from app.work_pools import POOLS
from tasks.shared import servers
from tasks.shared.errors import (
    TeamAuthError,
    TeamJoinFileError,
    TeamStackError,
    TeamUnreachableError,
)
from tasks.shared.log_tail import tail
from tasks.shared.settings import Settings

if TYPE_CHECKING:
    from tasks.shared.object_store import S3Server

TEAM_DIR = "team"  # <home>/team on the server machine
JOIN_DIR = "team-join"  # <home>/team-join on a GPU machine
JOIN_FILE = "team.env"
BUCKET = "imageops"
MLFLOW_ADMIN = "admin"
PREFECT_USER = "imageops"  # the user part of the Prefect auth string
DB_SUPERUSER = "postgres"
DB_ROLE = "imageops"  # the role Prefect and MLflow connect as (not a superuser)
DATABASES = ("prefect", "mlflow", "mlflow_auth")
START_TIMEOUT_S = 180.0
RAY_STOP_TIMEOUT_S = 40.0  # `ray start --block` drains its node for up to 30 s on SIGTERM
POSTGRES_STOP_TIMEOUT_S = 20.0
CHECK_TIMEOUT_S = 10.0
_QUIET = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
}

# Every variable of the join file, and what it is: the README lists the same, one line each.
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
    "IMAGEOPS_RAY_ADDRESS": "the Ray head (its GCS), SERVER:6379",
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


def _write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path``, owner-only from the first byte, replacing it atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    temporary.replace(path)
    return path


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def postgres_bin_dir() -> Path:
    """The folder of PostgreSQL's ``initdb`` and ``postgres``: PATH first, then Debian's."""
    candidates = []
    if found := shutil.which("postgres"):
        candidates.append(Path(found).resolve().parent)
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    for folder in candidates:
        if all(os.access(folder / name, os.X_OK) for name in ("initdb", "postgres")):
            return folder
    raise TeamStackError(
        "The PostgreSQL server programs (initdb, postgres) are not on PATH nor in "
        "/usr/lib/postgresql/*/bin.",
        "Install the PostgreSQL server (Debian/Ubuntu: `apt-get install postgresql`), then run "
        "`imageops team server` again.",
    )


def _postgres_user() -> str | None:
    """The account PostgreSQL runs as: ours, or ``postgres`` when we are root (it refuses root)."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(DB_SUPERUSER)
    except KeyError:
        raise TeamStackError(
            "PostgreSQL refuses to run as root, and there is no `postgres` account to run it as.",
            "Run `imageops team server` as an ordinary user, or create the account "
            "(`useradd --system postgres`).",
        ) from None
    return DB_SUPERUSER


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
        self.postgres_dir = self.dir / "postgres"
        self.s3: S3Server | None = None
        self.s3_url = f"http://{_url_host(host)}:{ports.s3}"
        self.ray_address = f"{_url_host(host)}:{ports.ray}"

    # --- secrets -----------------------------------------------------------------------------

    def secret(self, name: str, make: Callable[[], str] | None = None) -> str:
        """The kept secret ``name`` (a file of mode 0600 in ``secrets/``), made on first use."""
        self.secrets_dir.mkdir(parents=True, exist_ok=True)
        self.secrets_dir.chmod(0o700)
        return kept_secret(self.secrets_dir / name, make or (lambda: secrets.token_urlsafe(32)))

    def prefect_auth_string(self) -> str:
        return self.secret(
            "prefect-auth-string", lambda: f"{PREFECT_USER}:{secrets.token_urlsafe(32)}"
        )

    def s3_keys(self) -> tuple[str, str]:
        return (
            self.secret("s3-access-key", lambda: secrets.token_hex(10).upper()),
            self.secret("s3-secret-key", lambda: secrets.token_urlsafe(30)),
        )

    def prefect_client_settings(self) -> dict:
        from prefect.settings import PREFECT_API_AUTH_STRING

        return super().prefect_client_settings() | {
            PREFECT_API_AUTH_STRING: self.prefect_auth_string()
        }

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
        self.dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout_s
        try:
            postgres = self._start_postgres()
            self._start_s3()  # SeaweedFS takes a few seconds: PostgreSQL starts meanwhile
            self._wait_postgres(postgres, deadline)
            self._create_databases()
            self._start_mlflow()
            self._start_prefect()
            self._start_ray()
            self._wait(max(deadline - time.monotonic(), 1.0))
            self.say("servers up; creating the work pools and registering the deployments")
            for pool in POOLS:
                self._create_pool(pool)
            self._register_deployments()
            _write_private(self.join_file, self._join_file_text())
        except BaseException:
            self.stop()
            raise

    def _server_environment(self) -> dict[str, str]:
        """This environment without client settings that would point a server elsewhere."""
        clients = ("PREFECT_API_", "MLFLOW_TRACKING_", "MLFLOW_REGISTRY_", "RAY_ADDRESS")
        return {k: v for k, v in os.environ.items() if not k.startswith(clients)} | _QUIET

    def _database_url(self, database: str, driver: str) -> str:
        password = self.secret("postgres-imageops-password")
        host = _url_host(self.host)
        return f"{driver}://{DB_ROLE}:{password}@{host}:{self.team_ports.postgres}/{database}"

    # PostgreSQL

    def _start_postgres(self) -> subprocess.Popen:
        bin_dir = postgres_bin_dir()
        user = _postgres_user()
        data = self.postgres_dir
        if not (data / "PG_VERSION").is_file():
            self._initdb(bin_dir, user)
        self._allow_network_logins()
        service = self._launch(
            "postgres",
            [str(bin_dir / "postgres"), "-D", str(data), "-p", str(self.team_ports.postgres),
             "-c", f"listen_addresses={self.host}", "-c", "unix_socket_directories=",
             "-c", "password_encryption=scram-sha-256"],
            self._server_environment() | {"LC_ALL": "C"},
            user=user,
            stopper=lambda p: stop_leader_first(p, signal.SIGINT, POSTGRES_STOP_TIMEOUT_S),
        )  # fmt: skip
        assert service.process is not None
        return service.process

    def _initdb(self, bin_dir: Path, user: str | None) -> None:
        """A new cluster in ``team/postgres``: superuser ``postgres`` with a kept password."""
        data = self.postgres_dir
        data.mkdir(mode=0o700, parents=True, exist_ok=True)
        password = _write_private(self.dir / ".postgres-init", self.secret("postgres-password"))
        as_user: dict = {}
        if user is not None:
            account = pwd.getpwnam(user)
            for path in (data, password):
                os.chown(path, account.pw_uid, account.pw_gid)
            as_user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
            reach = subprocess.run(["test", "-w", str(data)], check=False, **as_user)
            if reach.returncode != 0:
                password.unlink()
                raise TeamStackError(
                    f"PostgreSQL runs as the `{user}` account (it refuses root), which cannot "
                    f"reach {data}: a folder above it is private to root.",
                    "Run `imageops team server` as an ordinary user, or keep the project (or "
                    "IMAGEOPS_HOME) in a folder others may enter, e.g. /srv/imageops.",
                )
        try:
            done = subprocess.run(
                [str(bin_dir / "initdb"), "-D", str(data), "-U", DB_SUPERUSER,
                 f"--pwfile={password}", "-A", "scram-sha-256", "-E", "UTF8", "--locale=C"],
                cwd=data, env=os.environ | {"LC_ALL": "C"}, capture_output=True, text=True,
                timeout=120, check=False, **as_user,
            )  # fmt: skip
        finally:
            password.unlink(missing_ok=True)
        if done.returncode != 0:
            raise TeamStackError(
                f"initdb could not create the database cluster in {data}:\n"
                f"{(done.stdout + done.stderr)[-1500:]}",
                f"Fix what it says; remove {data} before trying again if it is half made.",
            )

    def _allow_network_logins(self) -> None:
        """Password logins (SCRAM) from other machines; initdb's file allows loopback only."""
        if self.host in ("127.0.0.1", "::1", "localhost"):
            return
        hba = self.postgres_dir / "pg_hba.conf"
        marker = "# imageops team server: password logins over the network"
        text = hba.read_text()
        if marker not in text:
            hba.write_text(
                f"{text.rstrip()}\n{marker}\n"
                "host all all 0.0.0.0/0 scram-sha-256\nhost all all ::/0 scram-sha-256\n"
            )

    def _superuser_connection(self):  # -> psycopg.Connection
        import psycopg

        return psycopg.connect(
            host=self.host, port=self.team_ports.postgres, user=DB_SUPERUSER,
            password=self.secret("postgres-password"), dbname="postgres", connect_timeout=3,
            autocommit=True,
        )  # fmt: skip

    def _wait_postgres(self, process: subprocess.Popen, deadline: float) -> None:
        import psycopg

        def ready() -> bool:
            self.check_alive()
            try:
                with self._superuser_connection():
                    return True
            except psycopg.OperationalError:
                return False

        if not servers.wait_until(ready, max(deadline - time.monotonic(), 1.0), interval_s=0.3):
            raise TeamStackError(
                f"PostgreSQL did not answer on {self.host}:{self.team_ports.postgres}. End of "
                f"its log:\n{tail(self.dir / 'logs' / 'postgres.log')}",
                f"Read {self.dir / 'logs' / 'postgres.log'}.",
            )

    def _create_databases(self) -> None:
        """The servers' role (its kept password set again: that is how it rotates) and DBs."""
        from psycopg import sql

        password = self.secret("postgres-imageops-password")
        with self._superuser_connection() as conn:
            role = sql.Identifier(DB_ROLE)
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (DB_ROLE,))
            verb = "ALTER" if exists.fetchone() else "CREATE"
            conn.execute(
                sql.SQL(verb + " ROLE {} WITH LOGIN PASSWORD {}").format(
                    role, sql.Literal(password)
                )
            )
            for name in DATABASES:
                found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
                if not found.fetchone():
                    conn.execute(
                        sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(name), role)
                    )

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
            f"database_uri = {self._database_url('mlflow_auth', 'postgresql+psycopg')}\n"
            f"admin_username = {MLFLOW_ADMIN}\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n",
        )
        assert self.s3 is not None
        port = self.ports.mlflow
        hosts = [self.host, f"{self.host}:{port}", "localhost", f"localhost:{port}"]
        self._launch(
            "mlflow-server",
            [_tool("mlflow"), "server", "--app-name", "basic-auth", "--host", self.host,
             "--port", str(port), "--workers", "1",
             "--backend-store-uri", self._database_url("mlflow", "postgresql+psycopg"),
             "--artifacts-destination", f"s3://{BUCKET}/mlartifacts", "--serve-artifacts",
             "--allowed-hosts", ",".join(dict.fromkeys(hosts))],
            self._server_environment() | self.s3.environment() | {
                "MLFLOW_AUTH_CONFIG_PATH": str(auth_ini),
                # Used only while the admin user does not exist yet (the first start).
                "MLFLOW_AUTH_ADMIN_PASSWORD": self.secret("mlflow-admin-password"),
                "MLFLOW_FLASK_SERVER_SECRET_KEY": self.secret("mlflow-flask-secret-key"),
                "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            },
        )  # fmt: skip

    def _start_prefect(self) -> None:
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
                "PREFECT_API_DATABASE_CONNECTION_URL": self._database_url(
                    "prefect", "postgresql+asyncpg"
                ),
                "PREFECT_SERVER_API_AUTH_STRING": self.prefect_auth_string(),
            },
        )  # fmt: skip

    def _start_ray(self) -> None:
        self._launch(
            "ray-head",
            [_tool("ray"), "start", "--head", "--node-ip-address", self.host,
             "--port", str(self.team_ports.ray), "--num-cpus", "0", "--num-gpus", "0",
             "--disable-usage-stats", "--include-dashboard=false",
             "--temp-dir", str(self.dir / "ray"), "--block"],
            self._server_environment() | {
                "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": self.secret("ray-auth-token", lambda: secrets.token_hex(32)),
            },
            stopper=lambda p: stop_leader_first(p, signal.SIGTERM, RAY_STOP_TIMEOUT_S),
        )  # fmt: skip

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
            "# imageops team join file: every variable a GPU machine needs (see the README,",
            "# 'A team on several machines'). It holds passwords: keep it mode 0600.",
            "# Use: imageops team join --env team.env   (or: set -a; . ./team.env; set +a)",
        ]
        lines += [f"{k}={shlex.quote(v)}" for k, v in self.join_variables().items()]
        return "\n".join(lines) + "\n"


def _tcp_open(host: str, port: int, timeout_s: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


# --- a GPU machine joins -------------------------------------------------------------------


def read_join_file(path: Path) -> dict[str, str]:
    """The join file's variables; refused when missing, unreadable, open to others or short."""
    copy = (
        "Copy it from the server machine (`scp SERVER:PROJECT/.imageops/team/team.env .`) and "
        f"`chmod 600 {path}`."
    )
    if not path.is_file():
        raise TeamJoinFileError(f"The join file {path} does not exist.", copy)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise TeamJoinFileError(
            f"The join file {path} may be read by others (mode {mode:o}); it holds the team's "
            "passwords.",
            f"`chmod 600 {path}`, then run the command again.",
        )
    try:
        text = path.read_text()
    except OSError as exc:
        raise TeamJoinFileError(f"Cannot read the join file {path}: {exc.strerror}.", copy) from exc
    values: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)", line)
        if not match:
            raise TeamJoinFileError(f"{path}, line {number}: not NAME=value: {line[:40]!r}.", copy)
        try:
            words = shlex.split(match.group(2))
        except ValueError as exc:
            raise TeamJoinFileError(f"{path}, line {number}: {exc}.", copy) from exc
        values[match.group(1)] = " ".join(words)
    missing = [name for name in JOIN_VARIABLES if not values.get(name)]
    if missing:
        raise TeamJoinFileError(f"The join file {path} lacks {', '.join(missing)}.", copy)
    return values


def address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host``: the one the server's machines reach."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))  # UDP: nothing is sent, the kernel only picks the route
        return sock.getsockname()[0]


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def check_servers(values: dict[str, str], pool: str, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Every server of the join file answers and takes its credentials, else one clear error."""
    import httpx
    from botocore.exceptions import BotoCoreError, ClientError

    from tasks.shared.object_store import s3_client

    again = "Copy the join file again from the server machine (it changes when secrets rotate)."

    def unreachable(what: str, where: str, exc: object) -> TeamUnreachableError:
        return TeamUnreachableError(
            f"The {what} at {where} does not answer: {exc}.",
            f"Check that `imageops team server` runs on the server machine and that this "
            f"machine reaches {where} (route, firewall).",
        )

    api = values["PREFECT_API_URL"]
    user, _, password = values["PREFECT_API_AUTH_STRING"].partition(":")
    try:
        httpx.get(f"{api}/health", timeout=timeout_s).raise_for_status()
        answer = httpx.get(f"{api}/work_pools/{pool}", auth=(user, password), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise unreachable("Prefect server", api, exc) from exc
    if answer.status_code == 401:
        raise TeamAuthError(
            f"The Prefect server at {api} refused the join file's PREFECT_API_AUTH_STRING (401).",
            again,
        )
    if answer.status_code == 404:
        raise TeamStackError(
            f"The Prefect server at {api} has no work pool {pool!r}.",
            f"Join one of {', '.join(POOLS)} (--pool), which `imageops team server` creates.",
        )

    mlflow = values["IMAGEOPS_MLFLOW_TRACKING_URI"]
    login = (values["MLFLOW_TRACKING_USERNAME"], values["MLFLOW_TRACKING_PASSWORD"])
    try:
        answer = httpx.get(
            f"{mlflow}/api/2.0/mlflow/experiments/search",
            params={"max_results": 1}, auth=login, timeout=timeout_s,
        )  # fmt: skip
    except httpx.HTTPError as exc:
        raise unreachable("MLflow server", mlflow, exc) from exc
    if answer.status_code in (401, 403):
        raise TeamAuthError(
            f"The MLflow server at {mlflow} refused the join file's MLFLOW_TRACKING_USERNAME / "
            f"MLFLOW_TRACKING_PASSWORD ({answer.status_code}).",
            again,
        )

    endpoint = values["IMAGEOPS_S3_ENDPOINT_URL"]
    client = s3_client(
        endpoint, values["AWS_ACCESS_KEY_ID"], values["AWS_SECRET_ACCESS_KEY"],
        timeout_s=timeout_s, attempts=1,
    )  # fmt: skip
    try:
        client.head_bucket(Bucket=BUCKET)
    except ClientError as exc:
        raise TeamAuthError(
            f"The S3 server at {endpoint} refused the join file's AWS_ACCESS_KEY_ID / "
            f"AWS_SECRET_ACCESS_KEY for bucket {BUCKET!r}: {exc}.",
            again,
        ) from exc
    except BotoCoreError as exc:
        raise unreachable("S3 server", endpoint, exc) from exc

    ray = values["IMAGEOPS_RAY_ADDRESS"]
    if not _tcp_open(*_split_address(ray), timeout_s=timeout_s):
        raise unreachable("Ray head", ray, "no connection")


class TeamMember(Services):
    """A GPU machine in the team: a Ray worker node and a Prefect worker, until Ctrl-C."""

    command = "imageops team join"

    def __init__(
        self,
        settings: Settings,
        join_file: Path,
        *,
        node_ip: str | None = None,
        pool: str = "local",
        num_cpus: int | None = None,
        num_gpus: int | None = None,
        say: Callable[[str], None] = print,
    ) -> None:
        super().__init__(settings.home_dir / JOIN_DIR, settings.project_root)
        if pool not in POOLS:
            raise TeamStackError(
                f"Unknown work pool {pool!r}.", f"Use one of {', '.join(POOLS)} (--pool)."
            )
        self.settings, self.join_file, self.pool = settings, join_file, pool
        self.num_cpus, self.num_gpus, self.say = num_cpus, num_gpus, say
        self.values = read_join_file(join_file)
        self.ray_address = self.values["IMAGEOPS_RAY_ADDRESS"]
        self.node_ip = node_ip or address_towards(*_split_address(self.ray_address))
        self.worker_name = f"{socket.gethostname()}-{self.node_ip}"

    def environment(self) -> dict[str, str]:
        """The Ray node's and the Prefect worker's (and so every flow run's) environment."""
        v = self.values
        settings = Settings(
            project_root=self.settings.project_root,
            home=self.settings.home_dir,
            mlflow_tracking_uri=v["IMAGEOPS_MLFLOW_TRACKING_URI"],
            prefect_api_url=v["IMAGEOPS_PREFECT_API_URL"],
            dvc_remote_url=v["IMAGEOPS_DVC_REMOTE_URL"],
            s3_endpoint_url=v["IMAGEOPS_S3_ENDPOINT_URL"],
            checkpoint_url=v["IMAGEOPS_CHECKPOINT_URL"],
            registered_model_name=self.settings.registered_model_name,
            mlflow_experiment=self.settings.mlflow_experiment,
        )
        return dict(os.environ) | v | settings.environment() | {"RAY_USAGE_STATS_ENABLED": "0"}

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Check every server, then start the Ray node and the Prefect worker."""
        check_servers(self.values, self.pool)
        env = self.environment()
        try:
            args = [_tool("ray"), "start", "--address", self.ray_address,
                    "--node-ip-address", self.node_ip, "--disable-usage-stats",
                    "--temp-dir", str(self.dir / "ray"), "--block"]  # fmt: skip
            if self.num_cpus is not None:
                args += ["--num-cpus", str(self.num_cpus)]
            if self.num_gpus is not None:
                args += ["--num-gpus", str(self.num_gpus)]
            ray = self._launch(
                "ray-worker", args, env,
                stopper=lambda p: stop_leader_first(p, signal.SIGTERM, RAY_STOP_TIMEOUT_S),
            )  # fmt: skip
            self._wait_ray(ray.log, timeout_s)
            self._launch(
                "prefect-worker",
                [_tool("prefect"), "worker", "start", "--pool", self.pool,
                 "--type", POOLS[self.pool], "--name", self.worker_name],
                env,
            )  # fmt: skip
        except BaseException:
            self.stop()
            raise

    def _wait_ray(self, log: Path | None, timeout_s: float) -> None:
        assert log is not None

        def started() -> bool:
            text = log.read_text(errors="replace") if log.is_file() else ""
            if "InvalidAuthToken" in text or "AuthenticationError" in text:
                raise TeamAuthError(
                    f"The Ray head at {self.ray_address} refused the join file's RAY_AUTH_TOKEN.",
                    "Copy the join file again from the server machine.",
                )
            self.check_alive()
            return "Ray runtime started" in text

        if not servers.wait_until(started, timeout_s, interval_s=0.5):
            raise TeamUnreachableError(
                f"This machine's Ray node ({self.node_ip}) did not join the Ray head at "
                f"{self.ray_address} within {timeout_s:.0f} s. End of {log}:\n{tail(log)}",
                "Check that the head reaches this machine at --node-ip (Ray connects both "
                "ways) and that no firewall is in between.",
            )
