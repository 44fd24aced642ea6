"""PostgreSQL of the team stack: one cluster, Prefect's and MLflow's databases, password logins.

``initdb`` once into ``<home>/team/postgres`` (superuser ``postgres`` with its own kept password,
SCRAM logins only), then ``postgres`` in the foreground, listening on the team's address only
over TCP (no unix socket), as the ``postgres`` account when started by root (PostgreSQL refuses
root). The servers log in as ``imageops``, which owns their databases and is no superuser.
Details: docs/stack.md#the-team-stack-imageops-team.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.shared import servers
from tasks.shared.errors import TeamAuthError, TeamStackError
from tasks.shared.log_tail import tail

if TYPE_CHECKING:
    import psycopg

DB_SUPERUSER = "postgres"
DB_ROLE = "imageops"  # the role Prefect and MLflow connect as (not a superuser)
DATABASES = ("prefect", "mlflow", "mlflow_auth")


def _write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path``, owner-only from the first byte, replacing it atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    temporary.replace(path)
    return path


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


def postgres_user() -> str | None:
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


class TeamPostgres:
    """The team's PostgreSQL cluster in ``data``: made once, started by the caller, then set up."""

    def __init__(
        self, data: Path, *, host: str, port: int, superuser_password: str, role_password: str,
        log: Path,
    ) -> None:  # fmt: skip
        self.data, self.host, self.port, self.log = data, host, port, log
        self.superuser_password, self.role_password = superuser_password, role_password
        self.bin_dir = postgres_bin_dir()
        self.user = postgres_user()

    def prepare(self) -> list[str]:
        """Make the cluster if there is none; the command that runs it in the foreground."""
        if not (self.data / "PG_VERSION").is_file():
            self._initdb()
        self._allow_network_logins()
        return [
            str(self.bin_dir / "postgres"), "-D", str(self.data), "-p", str(self.port),
            "-c", f"listen_addresses={self.host}", "-c", "unix_socket_directories=",
            "-c", "password_encryption=scram-sha-256",
        ]  # fmt: skip

    def url(self, database: str, driver: str) -> str:
        """The servers' login to ``database`` (``driver``: postgresql+asyncpg, +psycopg)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{driver}://{DB_ROLE}:{self.role_password}@{host}:{self.port}/{database}"

    def _initdb(self) -> None:
        """A new cluster in ``team/postgres``: superuser ``postgres`` with a kept password."""
        data, bin_dir, user = self.data, self.bin_dir, self.user
        data.mkdir(mode=0o700, parents=True, exist_ok=True)
        password = _write_private(data.parent / ".postgres-init", self.superuser_password)
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
        hba = self.data / "pg_hba.conf"
        marker = "# imageops team server: password logins over the network"
        text = hba.read_text()
        if marker not in text:
            hba.write_text(
                f"{text.rstrip()}\n{marker}\n"
                "host all all 0.0.0.0/0 scram-sha-256\nhost all all ::/0 scram-sha-256\n"
            )

    def connect(self, password: str | None = None) -> psycopg.Connection:
        """A connection as the superuser, over TCP (the cluster has no unix socket)."""
        import psycopg

        return psycopg.connect(
            host=self.host, port=self.port, user=DB_SUPERUSER,
            password=password or self.superuser_password, dbname="postgres", connect_timeout=3,
            autocommit=True,
        )  # fmt: skip

    def wait(
        self, check_alive: Callable[[], None], timeout_s: float, previous: str | None = None
    ) -> None:
        """Until it takes the superuser's login; ``check_alive`` raises if a service died.

        ``previous``: the superuser's password before a rotation; used once to set the new one.
        """
        import psycopg
        from psycopg import sql

        def ready() -> bool:
            check_alive()
            try:
                with self.connect():
                    return True
            except psycopg.OperationalError as exc:
                if "password authentication failed" not in str(exc):
                    return False  # not up yet
            if previous is None:
                raise TeamAuthError(
                    f"PostgreSQL on {self.host}:{self.port} refused the kept superuser password "
                    "(secrets/postgres-password): it is not the cluster's.",
                    "Put the cluster's password back in that file; to rotate it, rename the old "
                    "file to postgres-password.old instead and start again.",
                )
            with self.connect(previous) as conn:
                conn.execute(
                    sql.SQL("ALTER ROLE {} WITH PASSWORD {}").format(
                        sql.Identifier(DB_SUPERUSER), sql.Literal(self.superuser_password)
                    )
                )
            return True

        if not servers.wait_until(ready, timeout_s, interval_s=0.3):
            raise TeamStackError(
                f"PostgreSQL did not answer on {self.host}:{self.port}. End of "
                f"its log:\n{tail(self.log)}",
                f"Read {self.log}.",
            )

    def create_databases(self) -> None:
        """The servers' role (its kept password set again: that is how it rotates) and DBs."""
        from psycopg import sql

        password = self.role_password
        with self.connect() as conn:
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
