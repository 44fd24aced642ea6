"""A throw-away project folder for tests: its settings applied, every change undone afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.shared.settings import Settings


def use_project(root: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Make ``root`` (created here) the current project, its settings applied to the environment.

    Every variable goes through ``monkeypatch``, so all of it is undone when the test (or the
    fixture's scope) ends.
    """
    root.mkdir()
    monkeypatch.setenv("IMAGEOPS_PROJECT_ROOT", str(root))
    monkeypatch.setenv("IMAGEOPS_HOME", str(root / ".imageops"))
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "PREFECT_HOME", "TORCH_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(root)
    settings = Settings()
    # apply() writes os.environ directly; monkeypatch.setenv first so the values are restored.
    for key, value in settings.environment().items():
        monkeypatch.setenv(key, value)
    settings.home_dir.mkdir(parents=True, exist_ok=True)
    return settings


def imageops(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The ``imageops`` command, as a user runs it in ``cwd`` (a wide terminal: one option a
    line in ``--help``)."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )


def dvc(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The ``dvc`` command, as a user runs it in ``cwd``; its stages find ``imageops`` on PATH."""
    env = dict(os.environ)
    # the stages call `imageops`, which lives beside this interpreter
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        [sys.executable, "-m", "dvc", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
