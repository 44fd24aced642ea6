"""dvc.yaml: the DVC-stage form of the pipeline is valid and its data stages reproduce for real."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from projects import dvc

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_dvc_repro_runs_the_data_stages(project) -> None:
    root = project.project_root
    shutil.copy(ROOT / "dvc.yaml", root)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["split"]["fraction"] = 0.8
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    assert dvc("init", "-q", cwd=root).returncode == 0

    stages = dvc("stage", "list", "--name-only", cwd=root)
    assert stages.returncode == 0, stages.stderr
    assert stages.stdout.split() == [
        "sample", "convert", "split", "transform", "model", "train", "score", "evaluate"
    ]  # fmt: skip
    dag = dvc("dag", "--dot", cwd=root)
    assert dag.returncode == 0, dag.stderr
    edges = ('"split" -> "train"', '"transform" -> "train"', '"train" -> "score"',
             '"score" -> "evaluate"')  # fmt: skip
    for edge in edges:
        assert edge in dag.stdout, dag.stdout

    result = dvc("repro", "split", cwd=root)
    assert result.returncode == 0, result.stdout + result.stderr
    train = yaml.safe_load((root / "dvc.lock").read_text())["stages"]["split"]
    assert train["params"]["params.yaml"]["split"]["fraction"] == 0.8
    assert (root / "data/repro/train/manifest.json").is_file()
    n_train = len(list((root / "data/repro/train").rglob("*.png")))
    n_val = len(list((root / "data/repro/val").rglob("*.png")))
    assert (n_train, n_val) == (1433, 364)  # floor(0.8 * n) per class of the 1,797 digits

    status = dvc("status", "split", cwd=root)
    assert status.returncode == 0 and "up to date" in status.stdout.lower(), status.stdout
    lock_before = (root / "dvc.lock").read_bytes()
    again = dvc("repro", "split", cwd=root)  # nothing changed: a no-op
    assert again.returncode == 0, again.stderr
    assert "Running stage" not in again.stdout, again.stdout
    assert (root / "dvc.lock").read_bytes() == lock_before

    params["split"]["seed"] = 2  # a changed parameter re-runs only what depends on it
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    rerun = dvc("repro", "split", cwd=root)
    assert rerun.returncode == 0, rerun.stderr
    assert "Running stage 'split'" in rerun.stdout and "Running stage 'convert'" not in rerun.stdout

    # The model stage reads the whole `model` section: an option added there reaches the stage.
    params["model"].update(name="densenet121", memory_efficient=True)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    built = dvc("repro", "model", cwd=root)
    assert built.returncode == 0, built.stdout + built.stderr
    spec = json.loads((root / "data/repro/untrained/model.json").read_text())
    assert (spec["arch"], spec["memory_efficient"]) == ("densenet121", True)
