"""MLflow as people open it: the UI lands on the runs; the environment is kept across clones."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import mlflow

from tasks.shared.settings import Settings
from tasks.shared.tracking import EXPERIMENT_KIND, MODEL_TRAINING, configure_mlflow

ROOT = Path(__file__).resolve().parents[1]


def test_the_experiment_opens_on_its_runs(project: Settings) -> None:
    """Without the kind, MLflow 3's UI opens the experiment on its GenAI overview."""
    experiment_id = configure_mlflow(project)
    client = mlflow.MlflowClient(project.tracking_uri)
    assert client.get_experiment(experiment_id).tags[EXPERIMENT_KIND] == MODEL_TRAINING
    # an experiment made without it (an older imageops, or by hand) gets it on first use
    client.delete_experiment_tag(experiment_id, EXPERIMENT_KIND)
    assert configure_mlflow(project) == experiment_id
    assert client.get_experiment(experiment_id).tags[EXPERIMENT_KIND] == MODEL_TRAINING


def test_make_keeps_an_environment_whose_lock_only_got_newer(tmp_path: Path) -> None:
    """A fresh clone has new file times: the environment of the same lock content is kept."""
    for name in ("Makefile", "requirements.lock", "pyproject.toml", "imageops-venv-bin.pth"):
        shutil.copy(ROOT / name, tmp_path / name)
    content = (tmp_path / "requirements.lock").read_bytes() + (
        tmp_path / "pyproject.toml"
    ).read_bytes()
    key = hashlib.sha256(content).hexdigest()[:16]
    stamp = tmp_path / "venv" / f".installed-{key}"
    stamp.parent.mkdir()
    stamp.touch()
    os.utime(stamp, (1_000_000_000, 1_000_000_000))  # installed long before the clone
    dry = subprocess.run(
        ["make", "-n", "install", "VENV=venv"], cwd=tmp_path, capture_output=True, text=True
    )
    assert dry.returncode == 0, dry.stderr
    # Only the cheap check that the editable install points here; no new environment.
    assert "rm -rf" not in dry.stdout and "--requirement" not in dry.stdout, dry.stdout
    # a changed lock is another key: a fresh environment
    with (tmp_path / "requirements.lock").open("a") as lock:
        lock.write("# changed\n")
    changed = subprocess.run(
        ["make", "-n", "install", "VENV=venv"], cwd=tmp_path, capture_output=True, text=True
    )
    assert "rm -rf venv" in changed.stdout and "--requirement" in changed.stdout


def test_the_stacks_mlflow_page_opens_in_the_model_view_unless_the_browser_chose() -> None:
    """`mlflow server --app-name imageops` (what `imageops serve` runs): MLflow's page, with the
    model view remembered before MLflow's scripts read it, only where the browser has no choice
    (a person's switch to GenAI wins); MLflow's API answers as before. The browser's side:
    tests/test_stack.py, a fresh Chromium on the experiment's bare address."""
    from importlib.metadata import entry_points

    from starlette.testclient import TestClient

    from app.mlflow_ui import REMEMBER_MODEL_VIEW, server_args

    assert server_args() == ["--app-name", "imageops"]
    (entry,) = [e for e in entry_points(group="mlflow.app") if e.name == "imageops"]
    # No `with`: the server's start-up and shut-down (its lifespan) are not this test's.
    client = TestClient(entry.load(), base_url="http://localhost")
    page = client.get("/")
    assert page.status_code == 200
    head = page.text.split("<head>", 1)[1]
    assert head.startswith(REMEMBER_MODEL_VIEW.decode())  # before MLflow's own scripts
    assert "localStorage.getItem('mlflow.workflowType_v1')===null&&" in head
    assert page.text.count(REMEMBER_MODEL_VIEW.decode()) == 1
    script = client.get("/static-files/static/js/" + _main_script(page.text))
    assert script.status_code == 200 and REMEMBER_MODEL_VIEW not in script.content


def _main_script(page: str) -> str:
    return page.split('src="static-files/static/js/', 1)[1].split('"', 1)[0]


def test_numbers_are_logged_to_mlflow_as_people_read_them() -> None:
    """MLflow's UI shows a value as it was logged (issue 47: 0.027681401349539423): imageops logs
    7 significant digits, float32's, and a small learning rate keeps its own digits."""
    from tasks.shared.tracking import logged_value

    assert logged_value(0.027681401349539423) == 0.02768140
    assert logged_value(0.1 * 3) == 0.3  # 0.30000000000000004, the effective learning rate
    assert logged_value(3.2e-07) == 3.2e-07
    assert logged_value(123456.789) == 123456.8
