"""`imageops run` starts Prefect's temporary API itself, first thing: a real server that the flow
uses, that listens on 127.0.0.1 only, stops with the command, and says why when it cannot start."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.temporary_api import start_temporary_api
from models.errors import ImageOpsError

ROOT = Path(__file__).resolve().parents[1]

# A flow run through the temporary API, in a process of its own like `imageops run`.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    if sys.argv[2:] == ["prefect-first"]:  # a module imported Prefect before the server started
        import prefect
    from app.temporary_api import start_temporary_api

    api = start_temporary_api(Path(sys.argv[1]))
    from prefect import flow, get_client
    from prefect.context import get_run_context

    @flow
    def probe() -> str:
        return str(get_run_context().flow_run.id)

    url = api.wait()
    run_id = probe()
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run_id).state.type.value
    print(json.dumps({
        "url": url, "run_id": run_id, "state": state, "port": api.port,
        "server_code_here": "prefect.server.api.server" in sys.modules,
    }))
    """
)


def _env(home: Path, cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PYTHONPATH=str(ROOT), PREFECT_HOME=str(home), XDG_CACHE_HOME=str(cache))
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    return env


def _run_probes(
    project: Path, cache: Path, count: int = 1, *, prefect_first: bool = False
) -> list[dict]:
    """``count`` commands started at once in ``project``, each with its flow run's result."""
    project.mkdir()
    first = ["prefect-first"] if prefect_first else []
    probes = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(project / f"api-{i}.log"), *first],
            env=_env(project / "prefect", cache),
            cwd=project,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]
    results = []
    for probe in probes:
        try:
            out, err = probe.communicate(timeout=300)
        finally:
            probe.kill()
        assert probe.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _flow_runs(database: Path) -> list[str]:
    with sqlite3.connect(database) as db:
        return sorted(row[0].replace("-", "") for row in db.execute("SELECT id FROM flow_run"))


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_the_flow_runs_on_the_temporary_api_which_stops_with_the_process(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    # Two commands at once in a new project, on a machine with no migrated copy yet: one server
    # creates and migrates the database while the other waits, then both serve it (migrating
    # it twice at once fails: "duplicate column name").
    result, other = _run_probes(tmp_path / "first", cache, count=2)
    assert result["url"] == f"http://127.0.0.1:{result['port']}/api"
    assert result["state"] == other["state"] == "COMPLETED"
    assert result["port"] != other["port"]
    # The server's code ran in the server, not in the flow's process.
    assert result["server_code_here"] is False
    # Their database is the project's (PREFECT_HOME), with both runs; gone with the commands.
    ids = sorted(r["run_id"].replace("-", "") for r in (result, other))
    assert _flow_runs(tmp_path / "first" / "prefect" / "prefect.db") == ids
    assert not _listening(result["port"]) and not _listening(other["port"])
    # The first new project on this machine kept its freshly migrated database as a template...
    templates = list((cache / "imageops").glob("prefect-*-empty.db"))
    assert len(templates) == 1
    with sqlite3.connect(templates[0]) as db:
        assert db.execute("SELECT version_num FROM alembic_version").fetchone()
        assert db.execute("SELECT count(*) FROM flow_run").fetchone() == (0,)  # empty
    # ...from which the next new project starts, with its own database and its own runs; in a
    # process that imported Prefect first, on this one server still (no second of Prefect's own).
    (second,) = _run_probes(tmp_path / "second", cache, prefect_first=True)
    assert second["state"] == "COMPLETED" and second["run_id"] != result["run_id"]
    assert second["server_code_here"] is False
    assert _flow_runs(tmp_path / "second" / "prefect" / "prefect.db") == [
        second["run_id"].replace("-", "")
    ]


def test_a_configured_server_is_used_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    assert start_temporary_api(tmp_path / "api.log") is None
    assert os.environ["PREFECT_API_URL"] == "http://127.0.0.1:4200/api"
    assert not (tmp_path / "api.log").exists()


def test_a_server_that_cannot_start_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "")  # restored (unset) after the test
    monkeypatch.delenv("PREFECT_API_URL")
    # A database URL the server cannot open: it exits during start-up.
    monkeypatch.setenv(
        "PREFECT_API_DATABASE_CONNECTION_URL", "postgresql+asyncpg://u@127.0.0.1:1/x"
    )
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    api = start_temporary_api(tmp_path / "api.log")
    assert api is not None
    try:
        with pytest.raises(ImageOpsError) as caught:
            api.wait(timeout_s=120)
    finally:
        api.stop()
    assert "did not start" in caught.value.message
    assert str(tmp_path / "api.log") in caught.value.message
    assert "IMAGEOPS_PREFECT_API_URL" in caught.value.hint
    assert api.process.poll() is not None
