"""Shared fixtures: a throw-away project folder, real digits as PNG ImageDirectories, and S3.

Every test that touches MLflow, DVC or Prefect state gets its own project folder (``project``), so
tests never see each other's runs. The digits are real scans from scikit-learn, kept tiny (16x16,
a few classes, a few dozen images) so the suite stays fast on 2 cores.
"""

from __future__ import annotations

import os
import secrets
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# Before anything imports Prefect or MLflow: telemetry off, and no stray user settings.
os.environ.update(
    {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DVC_NO_ANALYTICS": "1",
        "DO_NOT_TRACK": "1",
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
)
for _var in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "PREFECT_API_URL"):
    os.environ.pop(_var, None)
# One compute thread per torch process (this one, torchrun's workers, flow runs, servers): pytest
# runs one worker per core, so the cores are taken already, and OpenMP threads that wait for a
# core spin. Measured on the busy 2-core CI machine: a resnet18 step on 16 px digits cost 1.0 s
# of CPU with torch's default 2 threads and 0.1 s with 1; a 2-epoch training run's processes
# 31 s against 14 s. torchrun sets the same for workers when it starts more than one per node.
# A value already set wins (to try the default: OMP_NUM_THREADS=2 make test).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ctrl-C as a terminal sends it, whatever started the suite: a shell without job control starts
# `make test &` with SIGINT ignored, which every command a test starts inherits, and the Ctrl-C
# tests then found commands that never stopped (a score and a cluster driver, SIGINT ignored by
# every process of the group). A handler here is SIG_DFL again in each child after its exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from prefect_runs import drain_prefect_workers  # noqa: E402
from projects import use_project  # noqa: E402
from server_processes import Processes  # noqa: E402

from tasks.shared.settings import Settings  # noqa: E402

if TYPE_CHECKING:
    from tasks.shared.object_store import S3Server


# The modules that start Ray nodes: `make test` runs them one after another on one worker (see
# pytest_xdist_make_scheduler). Beside each other, in the one full run that tried it, both of
# test_cluster_hosts' Ray nodes were SIGKILLed mid-job from outside (not reproduced alone).
RAY_MODULES = frozenset(
    {"tests/test_cluster.py", "tests/test_cluster_hosts.py", "tests/test_team.py"}
)
RAY_UNIT = "the Ray modules"
MODULE_SECONDS = Path(__file__).with_name("module_seconds.txt")


def work_unit(nodeid: str) -> str:
    """What one pytest worker runs whole: the test's module, or all the Ray modules together."""
    module = nodeid.split("::", 1)[0]
    return RAY_UNIT if module in RAY_MODULES else module


def module_seconds() -> dict[str, int]:
    """tests/module_seconds.txt: each module's measured wall seconds."""
    lines = MODULE_SECONDS.read_text().splitlines()
    rows = [line.split() for line in lines if line.strip() and not line.startswith("#")]
    return {module: int(figure) for figure, module in rows}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest work units first (tests/module_seconds.txt), each unit kept together.

    ``make test`` hands the units out in this order (``--no-loadscope-reorder``): whichever worker
    is free takes the next, so with the long ones gone first both end within seconds of each
    other. (pytest-xdist's own order, most tests first, left test_cluster_hosts, 3 tests and three
    minutes, for the end: one worker ran it alone for half a minute.)
    """
    seconds: Counter[str] = Counter()
    for module, figure in module_seconds().items():
        seconds[work_unit(module)] += figure
    items.sort(key=lambda item: (-seconds[work_unit(item.nodeid)], work_unit(item.nodeid)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadscope`` with the Ray modules as one unit: never two of them at once."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RayModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            unit = work_unit(nodeid)
            return unit if unit == RAY_UNIT else super()._split_scope(nodeid)

    return RayModulesTogether(config, log)  # type: ignore[arg-type]


# Makes the migrated, empty databases once per machine, in a process of its own (its settings
# stay out of ours): imageops' temporary API keeps Prefect's as the template a new project starts
# from, and a new project's first MLflow store keeps MLflow's.
_MAKE_TEMPLATES = """
import sys
from pathlib import Path
from app.temporary_api import start_temporary_api
from tasks.shared.settings import Settings
from tasks.shared.tracking import configure_mlflow
root = Path(sys.argv[1])
api = start_temporary_api(root / "api.log")
api.wait()
api.stop()
configure_mlflow(Settings(project_root=root, home=root / ".imageops"))
"""


@pytest.fixture(scope="session", autouse=True)
def database_templates(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The migrated, empty databases every new project and test server starts from
    (tasks.shared.database_templates), made before the first test: otherwise the session's
    first servers (the Prefect API of each worker, the served stack, the two hosts) each migrate
    their own, 5 to 18 s of CPU apiece, all at once."""
    import subprocess
    import sys

    from filelock import FileLock

    from tasks.shared.database_templates import template

    made = [template("prefect"), template("mlflow")]
    made[0].parent.mkdir(parents=True, exist_ok=True)
    with FileLock(made[0].with_name("templates.lock")):  # the other pytest workers wait
        if not all(path.is_file() for path in made):
            root = tmp_path_factory.mktemp("templates")
            env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
            subprocess.run(
                [sys.executable, "-c", _MAKE_TEMPLATES, str(root)],
                env=env | {"PREFECT_HOME": str(root / "prefect")},
                cwd=Path(__file__).resolve().parents[1],
                check=True,
                timeout=300,
            )


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[None]:
    """A real, temporary Prefect API (server and SQLite database) for the whole session.

    Its database starts as a copy of the migrated template (the harness makes its folder with
    ``mkdtemp``; the copy is put there first), as imageops' own temporary API's does.
    """
    import tempfile
    from unittest import mock

    from prefect.testing.utilities import prefect_test_harness

    from tasks.shared.database_templates import seed

    def seeded() -> str:
        folder = tempfile.mkdtemp()
        seed("prefect", Path(folder) / "prefect-test.db")
        return folder

    drain_prefect_workers()  # bound to a server an earlier test started (prefect_api_at)
    with (
        mock.patch("prefect.testing.utilities.mkdtemp", seeded),
        prefect_test_harness(server_startup_timeout=120),
    ):
        yield


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings for a fresh project folder under ``tmp_path`` (applied to the environment)."""
    return use_project(tmp_path / "project", monkeypatch)


@pytest.fixture(scope="session")
def digits_raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A raw image folder: 3 digit classes x 30 real scans, 16x16 RGB PNG. Do not modify."""
    from tasks.data.sample import write_digits

    return write_digits(
        tmp_path_factory.mktemp("raw") / "digits", size=16, classes=[0, 1, 2], per_class=30
    )


@pytest.fixture(scope="session")
def digits_split(tmp_path_factory: pytest.TempPathFactory, digits_raw: Path) -> tuple[Path, Path]:
    """(train, val) ImageDirectories made from ``digits_raw`` (80/20). Do not modify."""
    from tasks.data.convert import convert
    from tasks.data.split import split

    root = tmp_path_factory.mktemp("imagedirs")
    convert(digits_raw, root / "images")
    split(root / "images", root / "train", root / "val", fraction=0.8, seed=1)
    return root / "train", root / "val"


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    """Processes a test starts: all stopped at the end, their logs shown when it failed."""
    procs = Processes(tmp_path / "logs")
    try:
        yield procs
    finally:
        procs.stop()
        print(procs.report())  # shown by pytest only when the test failed


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3 server (SeaweedFS) for a module, with keys made up here: give each test a
    bucket of its own (``s3_bucket``). Not for the session: idle, it still takes about 1% of a
    core, which a whole run of the suite would pay for nothing."""
    from tasks.shared.object_store import start_seaweedfs

    server = start_seaweedfs(
        tmp_path_factory.mktemp("seaweedfs"),
        access_key=f"test-{secrets.token_hex(4)}",
        secret_key=secrets.token_urlsafe(24),
    )
    try:
        yield server
    finally:
        server.stop(timeout_s=2)  # it ignores SIGTERM for 15 s; nothing is kept after the tests


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A new, empty bucket on ``s3_server`` for this test alone."""
    from tasks.shared.object_store import ensure_bucket

    bucket = f"test-{secrets.token_hex(6)}"
    ensure_bucket(s3_server.endpoint_url, bucket, s3_server.access_key, s3_server.secret_key)
    return bucket
