"""Scale-out on PostgreSQL: MLflow, Prefect and Optuna keep their state in one database server.

The test starts a throw-away PostgreSQL cluster (``initdb`` + ``pg_ctl``, a free port on
127.0.0.1, trust authentication), a real ``mlflow server`` and a real ``prefect server start`` on
it, works through them as the pipeline does (a run, a model version and its alias; a flow run; a
tuning study through the project's storage code), and reads each result back from PostgreSQL's
own tables, so nothing can have landed in a SQLite file by mistake.

PostgreSQL's server binaries are looked up on PATH and where distributions install them. When
there are none, a root user with apt-get gets them installed once (Debian's ``postgresql``; set
``IMAGEOPS_TEST_INSTALL_POSTGRES=0`` to forbid that); otherwise the test is skipped and says why.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prefect_runs import prefect_api_at
from server_processes import Processes, base_env, free_port, healthy

from tasks.shared.settings import Settings

DATABASES = ("mlflow", "prefect", "optuna")
DB_USER = "imageops"
# Where distributions put the server binaries (Debian/Ubuntu, RHEL's PGDG, source, Homebrew).
BIN_DIRS = (
    "/usr/lib/postgresql/*/bin",
    "/usr/pgsql-*/bin",
    "/usr/local/pgsql/bin",
    "/opt/homebrew/opt/postgresql*/bin",
)
INSTALL_HINT = (
    "install the PostgreSQL server (Debian/Ubuntu: `apt-get install postgresql`; "
    "RHEL/Fedora: `dnf install postgresql-server`; macOS: `brew install postgresql`)"
)
INSTALL_TIMEOUT_S = 300

pytestmark = pytest.mark.slow


# --- PostgreSQL -------------------------------------------------------------------------------


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", str(path)))


def _bin_dir() -> Path | None:
    """A folder with ``initdb``, ``pg_ctl`` and ``postgres``: PATH first, then the newest found."""
    candidates = []
    if found := shutil.which("initdb"):
        candidates.append(Path(found).resolve().parent)
    if pg_config := shutil.which("pg_config"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            )
            candidates.append(Path(out.stdout.strip()))
    for pattern in BIN_DIRS:
        candidates += sorted(map(Path, glob.glob(pattern)), key=_version_key, reverse=True)
    for folder in candidates:
        if all(os.access(folder / name, os.X_OK) for name in ("initdb", "pg_ctl", "postgres")):
            return folder
    return None


def _install_with_apt() -> str:
    """Install Debian's ``postgresql`` (once, time-limited); what happened, for a skip reason."""
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "postgresql"]
    deadline = time.monotonic() + INSTALL_TIMEOUT_S
    out = ""
    for command in (install, ["apt-get", "update", "-q"], install):
        left = deadline - time.monotonic()
        try:
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=max(left, 1)
            )
        except subprocess.TimeoutExpired:
            return f"`{' '.join(command)}` took over {INSTALL_TIMEOUT_S} s"
        out = (done.stdout + done.stderr)[-1500:]
        if command is install and done.returncode == 0:
            return "installed"
    return f"`{' '.join(install)}` failed:\n{out}"


def _find_or_install() -> Path:
    if folder := _bin_dir():
        return folder
    missing = (
        f"PostgreSQL server binaries (initdb, pg_ctl, postgres) not found on PATH or in "
        f"{', '.join(BIN_DIRS)}: {INSTALL_HINT} to run this test"
    )
    allowed = os.environ.get("IMAGEOPS_TEST_INSTALL_POSTGRES", "1") != "0"
    if not (allowed and os.geteuid() == 0 and shutil.which("apt-get")):
        pytest.skip(missing)
    outcome = _install_with_apt()
    if folder := _bin_dir():
        return folder
    pytest.skip(f"{missing}; tried apt-get: {outcome}")


def _run_as() -> dict[str, Any]:
    """Popen arguments that drop root: PostgreSQL refuses to run as root."""
    if os.geteuid() != 0:
        return {}
    try:
        user = pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip(
            "running as root, which PostgreSQL refuses, and there is no `postgres` user to run "
            "it as: create one (`useradd --system postgres`) or run the tests as another user"
        )
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


@dataclass
class Postgres:
    """A running throw-away cluster: one database per service, reached over TCP as DB_USER."""

    bin_dir: Path
    root: Path
    port: int
    run_as: dict[str, Any] = field(default_factory=dict)

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "postgres.log"

    def url(self, database: str, driver: str = "postgresql+psycopg") -> str:
        return f"{driver}://{DB_USER}@127.0.0.1:{self.port}/{database}"

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """A PostgreSQL program, as the cluster's owner, from a folder that owner may enter."""
        return subprocess.run(
            [str(self.bin_dir / args[0]), *args[1:]],
            cwd=self.root,
            env=os.environ | {"LC_ALL": "C", "HOME": str(self.root)},
            capture_output=True,
            text=True,
            timeout=timeout,
            **self.run_as,
        )

    def query(self, database: str, sql: str, params: tuple = ()) -> list[tuple]:
        import psycopg

        with psycopg.connect(self.url(database, "postgresql"), autocommit=True) as conn:
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description else []

    def log_tail(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else "(no log)"
        return f"----- postgres -----\n{text[-3000:]}"

    def stop(self) -> None:
        """Fast shutdown; if pg_ctl cannot, signal the postmaster itself."""
        if not (self.data / "postmaster.pid").exists():
            return
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            if self.run("pg_ctl", "stop", "-D", str(self.data), "-m", "fast", "-w").returncode == 0:
                return
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
            os.kill(pid, signal.SIGQUIT)  # immediate shutdown of the postmaster and its children
            for _ in range(50):
                os.kill(pid, 0)
                time.sleep(0.1)
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    """A PostgreSQL cluster for this module, with the databases mlflow, prefect and optuna."""
    bin_dir = _find_or_install()
    run_as = _run_as()
    # Not under pytest's tmp_path: its parents are private to the user running the tests, and a
    # unix socket path must stay short (about 100 characters).
    root = Path(tempfile.mkdtemp(prefix="imageops-pg-"))
    if run_as:
        os.chown(root, run_as["user"], run_as["group"])
    pg = Postgres(bin_dir, root, free_port(), run_as)
    try:
        init = pg.run(
            "initdb", "-D", str(pg.data), "-U", DB_USER, "-A", "trust", "-E", "UTF8",
            "--locale=C", "--no-sync",
        )  # fmt: skip
        if init.returncode != 0:
            pytest.skip(
                f"initdb could not create a cluster here:\n{(init.stdout + init.stderr)[-1500:]}"
            )
        options = (
            f"-p {pg.port} -h 127.0.0.1 -k {root} "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        start = pg.run(
            "pg_ctl", "start", "-D", str(pg.data), "-l", str(pg.log), "-w", "-t", "60",
            "-o", options,
        )  # fmt: skip
        if start.returncode != 0:
            pytest.skip(
                f"PostgreSQL did not start ({start.stdout.strip()} {start.stderr.strip()})\n"
                f"{pg.log_tail()}"
            )
        for name in DATABASES:  # autocommit: CREATE DATABASE cannot run in a transaction
            pg.query("postgres", f"CREATE DATABASE {name}")
        yield pg
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


# --- servers ----------------------------------------------------------------------------------


@pytest.fixture
def processes(tmp_path: Path, postgres: Postgres) -> Iterator[Processes]:
    procs = Processes(tmp_path / "logs")
    try:
        yield procs
    finally:
        procs.stop()
        # Shown by pytest only when the test failed: what every server said last.
        print(procs.report(), postgres.log_tail(), sep="\n")


def _flow() -> Callable[..., Any]:
    from prefect import flow

    @flow(name="imageops-postgres-check", persist_result=False)
    def doubled(x: int) -> int:
        return 2 * x

    return doubled


def test_mlflow_and_prefect_servers_keep_their_state_in_postgres(
    postgres: Postgres,
    processes: Processes,
    project: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bin_dir = Path(sys.executable).parent
    prefect_port, mlflow_port = free_port(), free_port()
    base = base_env()
    # Both start at once, so their database migrations overlap.
    processes.start(
        "prefect-server",
        [str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1",
         "--port", str(prefect_port), "--no-ui", "--no-scheduler", "--no-late-runs"],
        base
        | {
            "PREFECT_HOME": str(tmp_path / "prefect-home"),
            "PREFECT_API_DATABASE_CONNECTION_URL": postgres.url("prefect", "postgresql+asyncpg"),
        },
    )  # fmt: skip
    processes.start(
        "mlflow-server",
        [str(bin_dir / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(mlflow_port),
         "--workers", "1", "--backend-store-uri", postgres.url("mlflow"),
         "--artifacts-destination", str(tmp_path / "mlflow-artifacts")],
        base,
    )  # fmt: skip

    # The project reaches both through its own settings, as a deployment would configure it.
    monkeypatch.setenv("IMAGEOPS_MLFLOW_TRACKING_URI", f"http://127.0.0.1:{mlflow_port}")
    monkeypatch.setenv("IMAGEOPS_PREFECT_API_URL", f"http://127.0.0.1:{prefect_port}/api")
    settings = Settings()
    assert settings.tracking_uri == f"http://127.0.0.1:{mlflow_port}"
    api = settings.environment()["PREFECT_API_URL"]

    # --- MLflow: a run, a model version, an alias; then the same rows in PostgreSQL.
    from mlflow import MlflowClient

    processes.wait("the MLflow server", lambda: healthy(f"{settings.tracking_uri}/health"))
    client = MlflowClient(settings.tracking_uri, settings.registry_uri)
    experiment_id = client.create_experiment(f"postgres-{uuid.uuid4().hex[:8]}")
    run = client.create_run(experiment_id)
    run_id = run.info.run_id
    client.log_param(run_id, "lr", 0.01)
    client.log_metric(run_id, "val_accuracy", 0.93)
    client.log_text(run_id, '{"architecture": "resnet18"}', "model/model.json")
    client.set_terminated(run_id)
    name = f"postgres-model-{uuid.uuid4().hex[:8]}"
    client.create_registered_model(name)
    version = client.create_model_version(
        name, f"{run.info.artifact_uri}/model", run_id=run_id
    ).version
    client.set_registered_model_alias(name, "champion", version)

    assert client.get_model_version_by_alias(name, "champion").run_id == run_id
    assert client.get_run(run_id).data.metrics == {"val_accuracy": 0.93}
    assert client.download_artifacts(run_id, "model/model.json", str(tmp_path / "dl"))
    assert postgres.query(
        "mlflow", "SELECT version, run_id FROM model_versions WHERE name = %s", (name,)
    ) == [(int(version), run_id)]
    assert postgres.query(
        "mlflow", "SELECT alias, version FROM registered_model_aliases WHERE name = %s", (name,)
    ) == [("champion", int(version))]
    assert postgres.query(
        "mlflow", "SELECT value FROM metrics WHERE run_uuid = %s AND key = %s",
        (run_id, "val_accuracy"),
    ) == [(0.93,)]  # fmt: skip

    # --- Prefect: a flow run against the server; then the same run in PostgreSQL.
    processes.wait("the Prefect server", lambda: healthy(f"{api}/health"))
    with prefect_api_at(api):
        state = _flow()(21, return_state=True)
    assert state.is_completed(), state
    assert state.result() == 42
    flow_run_id = str(state.state_details.flow_run_id)
    flow_run = httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()
    assert flow_run["state_type"] == "COMPLETED"
    assert flow_run["parameters"] == {"x": 21}
    assert postgres.query(
        "prefect", "SELECT state_type::text FROM flow_run WHERE id = %s", (flow_run_id,)
    ) == [("COMPLETED",)]


def test_a_tuning_study_lives_in_postgres(
    postgres: Postgres, project: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    import optuna

    from tasks.tune.storage import open_storage, quiet_optuna, storage_ref

    url = postgres.url("optuna")
    monkeypatch.setenv("IMAGEOPS_TUNING_STORAGE", url)
    settings = Settings()
    name = f"study-{uuid.uuid4().hex[:8]}"
    assert storage_ref(settings, name) is None  # the database, not a journal file
    assert "IMAGEOPS_TUNING_STORAGE" in settings.environment()  # training workers get it too

    quiet_optuna()
    study = optuna.create_study(
        study_name=name, storage=open_storage(None, settings), direction="maximize"
    )
    study.optimize(lambda trial: trial.suggest_float("lr", 1e-4, 1e-1, log=True), n_trials=2)

    # A fresh connection (another machine would have one) sees both trials.
    loaded = optuna.load_study(study_name=name, storage=url)
    assert [t.state for t in loaded.trials] == [optuna.trial.TrialState.COMPLETE] * 2
    assert loaded.best_value == max(t.value for t in study.trials)
    assert postgres.query(
        "optuna",
        "SELECT count(*) FROM trials JOIN studies USING (study_id) "
        "WHERE study_name = %s AND trials.state = 'COMPLETE'",
        (name,),
    ) == [(2,)]
