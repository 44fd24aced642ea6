"""Start Prefect's temporary API server first, while the flow's libraries are still importing.

Without ``PREFECT_API_URL``, Prefect would import its server code and start the server at the flow's
first call, before any task (3.5 s, then 5 to 18 s); started here first, it comes up on the other
core while torch and MLflow import. A new project starts from a migrated database template, and a
lock beside the database lets two commands share it.
Details: docs/stack.md#the-temporary-api-imageops-run-without-a-server.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

from models.errors import ImageOpsError
from models.locks import acquire
from tasks.shared import servers
from tasks.shared.database_templates import backup, copy_atomically, template
from tasks.shared.log_tail import tail

STARTUP_TIMEOUT_S = 120.0  # a new project's database migrations on a slow, busy machine


# Prefect's own database variables: a project that sets one keeps its database to itself.
DATABASE_VARIABLES = (
    "PREFECT_API_DATABASE_CONNECTION_URL",
    "PREFECT_SERVER_DATABASE_CONNECTION_URL",
)


def _database() -> Path | None:
    """The SQLite file the server will use, or None when the user configured a database."""
    if any(os.environ.get(name) for name in DATABASE_VARIABLES):
        return None
    return Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect") / "prefect.db"


def _launch(port: int, log: Path) -> subprocess.Popen[bytes]:
    import importlib.util

    spec = importlib.util.find_spec("prefect")  # locates the package without importing it
    assert spec is not None and spec.origin is not None, "prefect is not installed"
    env = {
        **os.environ,
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
    }
    command = [
        sys.executable, "-m", "uvicorn",
        "--app-dir", str(Path(spec.origin).parent.parent),
        "--factory", "prefect.server.api.server:create_app",
        "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "error", "--lifespan", "on",
    ]  # fmt: skip
    # Started from the main thread; SIGKILLed with this process, which cannot stop it then.
    return servers.start(command, log, env)


class TemporaryAPI:
    """The server process, the URL it serves and its log; :meth:`wait` before the flow runs."""

    def __init__(
        self, log: Path, save_template_to: Path | None = None, creating: FileLock | None = None
    ) -> None:
        self.log = log
        self.save_template_to = save_template_to  # a new database: keep a copy once migrated
        self.creating = creating  # held while this server migrates a new database
        self.port = servers.free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.process = _launch(self.port, log)

    def wait(self, timeout_s: float = STARTUP_TIMEOUT_S) -> str:
        """Return the API URL once it answers; raise with the server's log tail if it cannot."""
        # Exited ends the wait too: uvicorn's status 3 is any start-up failure.
        exited = self.process.poll
        up = servers.wait_until(
            lambda: exited() is not None or servers.healthy(f"{self.url}/health", timeout_s=2),
            timeout_s,
            interval_s=0.1,
        )
        if up and exited() is None:
            self._save_template()
            self._created()
            return self.url
        self.stop()
        raise ImageOpsError(
            f"Prefect's temporary API server on {self.url} did not start within {timeout_s:.0f} s "
            f"(exit status {self.process.poll()}). Its log ({self.log}) ends:\n{tail(self.log)}",
            "Fix what the log says (a full disk, a locked or damaged database under "
            "PREFECT_HOME), or run `imageops serve` and set IMAGEOPS_PREFECT_API_URL to use it.",
        )

    def _save_template(self) -> None:
        """Keep the just-migrated database for the next new project (best effort: a cache)."""
        database, made = _database(), self.save_template_to
        if made is None or database is None or made.exists():
            return
        # On failure there is no cache this time: the next new project migrates its own database.
        with contextlib.suppress(OSError, sqlite3.Error):
            copy_atomically(lambda tmp: backup(database, tmp), made)

    def _created(self) -> None:
        """The new database is migrated: other commands waiting to start on it may go on."""
        if self.creating is not None:
            self.creating.release()
            self.creating = None

    def stop(self) -> None:
        self._created()
        servers.stop(self.process)


def _creation_lock(database: Path) -> FileLock:
    """The lock on creating ``database``, acquired; another command may hold it while migrating."""
    lock = database.with_name(f"{database.name}.lock")
    return acquire(
        lock,
        STARTUP_TIMEOUT_S,
        ImageOpsError(
            f"Waited {STARTUP_TIMEOUT_S:.0f} s for another imageops command to create Prefect's "
            f"database {database} (it holds {lock}).",
            "Check for a stuck `imageops` command in this project and stop it, then run again.",
        ),
    )


def start_temporary_api(log: Path) -> TemporaryAPI | None:
    """Start the server now and export its ``PREFECT_API_URL``; None when one is configured.

    Call it early (the server starts while the flow's libraries import), and
    :meth:`TemporaryAPI.wait` before the flow. A server of
    your own (``PREFECT_API_URL`` already set) is always used instead. The server stops when this
    process exits.
    """
    if os.environ.get("PREFECT_API_URL"):
        return None
    log.parent.mkdir(parents=True, exist_ok=True)
    database, made, save_to, creating = _database(), template("prefect"), None, None
    if database is not None:
        # Even when the file is there: another command's server may be migrating it right now.
        lock = _creation_lock(database)
        if database.exists():
            lock.release()
        elif made.is_file():  # migrated once on this machine: start from that copy
            copy_atomically(lambda tmp: shutil.copyfile(made, tmp), database)
            lock.release()
        else:  # held until our server has migrated it (TemporaryAPI.wait)
            save_to, creating = made, lock
    api = TemporaryAPI(log, save_template_to=save_to, creating=creating)
    atexit.register(api.stop)
    os.environ["PREFECT_API_URL"] = api.url
    # Prefect reads its settings once, when imported: a module that imported it before this
    # call would leave it without the URL, and it would start a second server of its own.
    if "prefect.context" in sys.modules:
        sys.modules["prefect.context"].refresh_global_settings_context()
    return api
