"""Retention and ``imageops gc``: what a finished run gives back, what gc reclaims, and what it
never touches (a registered version's files, an aliased version's cache entry, a cache entry a
scoring reads, a job being trained, a running promotion, the cache entries of a .dvc file committed
on any branch or tag), on a real MLflow (SQLite), DVC and git."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from projects import imageops
from training_runs import FAST, PRE, run_train
from typer.testing import CliRunner

from app.cli import app
from app.cli.housekeeping import list_reclaimable
from models.atomic import temp_name
from models.locks import holding
from tasks.data.datasets import dataset_lock
from tasks.data.imagedir import MANIFEST
from tasks.data.versioning import ensure_dvc_repo, version
from tasks.inference.export import sha256_file
from tasks.inference.score import score
from tasks.registry.model_uri import (
    cache_path,
    fetch_registered_model,
    lease_path,
    leased,
    model_in_use,
)
from tasks.registry.promote import DECISION_FILE, PROMOTIONS_DIR, promotion_lock
from tasks.registry.register import register
from tasks.shared import faults
from tasks.shared.errors import RegistryError, TrainingFailedError
from tasks.shared.reclaim import TRASH, trash
from tasks.shared.settings import Settings
from tasks.shared.tracking import configure_mlflow
from tasks.train.request import CONFIG, TrainRequest, check_request
from tasks.train.retention import discard_checkpoints
from tasks.train.run_folder import BEST_WEIGHTS, CHECKPOINT
from tasks.train.run_lock import launch_lock

pytest_plugins = ["model_fixtures", "training_runs"]

NAME = "imageops-classifier"
OLD = time.time() - 30 * 86400  # a month ago: older than gc's default 7 days


def _paths(settings: Settings, kind: str | None = None) -> list[Path]:
    return [i.path for i in list_reclaimable(settings, 7.0) if kind is None or i.kind == kind]


def _age(folder: Path, when: float = OLD) -> Path:
    for path in [folder, *folder.rglob("*")]:
        os.utime(path, (when, when), follow_symlinks=False)
    return folder


def _run(settings: Settings, status: str) -> tuple[str, Path]:
    """A real MLflow run ended with ``status`` and a run folder as training leaves one."""
    client = MlflowClient(settings.tracking_uri)
    run_id = client.create_run(configure_mlflow(settings)).info.run_id
    client.set_terminated(run_id, status)
    run_dir = settings.runs_dir / run_id
    run_dir.mkdir(parents=True)
    for name in ("config.json", "result.json", "rank_0.log", CHECKPOINT):
        (run_dir / name).write_bytes(b"x" * 1000)
    return run_id, run_dir


def _gc(*args: str) -> str:
    result = CliRunner().invoke(app, ["gc", *args], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    return result.output


# --- retention: what a training run keeps once it is FINISHED ---------------------------------


@pytest.mark.slow
def test_a_finished_run_drops_its_checkpoint_and_a_failed_one_keeps_it_to_resume(
    project: Settings,
    untrained: Path,
    digits_split: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Killed (torchrun and worker) right after epoch 1's checkpoint: the run ends FAILED.
    monkeypatch.setenv(faults.FAULT, "train.epoch_end:epoch=1:kill_parent")
    with pytest.raises(TrainingFailedError):
        run_train(project, untrained, digits_split, tmp_path / "model", epochs=2)
    client = MlflowClient(project.tracking_uri)
    (failed,) = client.search_runs([configure_mlflow(project)])
    assert failed.info.status == "FAILED"
    run_dir = project.runs_dir / failed.info.run_id
    assert (run_dir / CHECKPOINT).is_file() and (run_dir / BEST_WEIGHTS).is_file()
    assert _paths(project, "run folder") == []  # gc keeps what a retry resumes from

    # The same request again continues that run from the checkpoint and finishes it: the
    # checkpoint and best weights go, the model and what MLflow was sent stay.
    monkeypatch.delenv(faults.FAULT)
    result = run_train(project, untrained, digits_split, tmp_path / "model", epochs=2)
    assert result.run_id == failed.info.run_id
    assert "resumed from the checkpoint after epoch 1" in (run_dir / "rank_0.log").read_text()
    assert client.get_run(result.run_id).info.status == "FINISHED"
    assert not (run_dir / CHECKPOINT).exists() and not (run_dir / BEST_WEIGHTS).exists()
    assert [p.name for p in run_dir.iterdir() if p.name.startswith(".")] == []
    assert (result.model_dir / "model.safetensors").is_file()
    assert {"config.json", "result.json", "rank_0.log"} <= {p.name for p in run_dir.iterdir()}
    # ... and the whole run folder is now something gc may reclaim.
    assert _paths(project, "run folder") == [run_dir]


def test_keep_checkpoints_keeps_them_and_the_store_copies_go_with_the_run_folders(
    project: Settings, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    settings = project.model_copy(update={"checkpoint_url": str(store)})
    run_dir = settings.runs_dir / "run-1"
    for folder in (run_dir, store / "run-1"):
        folder.mkdir(parents=True)
        for name in (CHECKPOINT, BEST_WEIGHTS):
            (folder / name).write_bytes(b"w" * 100)
    (run_dir / "result.json").write_text("{}")

    keeping = settings.model_copy(update={"keep_checkpoints": True})
    assert discard_checkpoints("run-1", run_dir, keeping) == 0
    assert len(list(run_dir.iterdir())) == 3 and len(list((store / "run-1").iterdir())) == 2

    assert discard_checkpoints("run-1", run_dir, settings) == 200
    assert [p.name for p in run_dir.iterdir()] == ["result.json"]
    assert not (store / "run-1").exists()


# --- imageops gc: what it reclaims ------------------------------------------------------------


def test_gc_lists_then_removes_finished_runs_old_outputs_and_trash(project: Settings) -> None:
    finished_id, finished = _run(project, "FINISHED")
    _, failed = _run(project, "FAILED")
    _, killed = _run(project, "KILLED")
    old = project.outputs_dir / "20250101-120000-digits-abcd1234"
    (old / "model").mkdir(parents=True)
    (old / "model" / "model.safetensors").write_bytes(b"w" * 5000)
    _age(old)
    new = project.outputs_dir / "20991231-235959-digits-0123abcd"
    (new / "model").mkdir(parents=True)
    trash = project.runs_dir / temp_name("some-run", TRASH)  # a removal a crash cut short
    trash.mkdir()
    (trash / CHECKPOINT).write_bytes(b"c" * 100)

    listed = list_reclaimable(project, 7.0)
    assert {(i.kind, i.path) for i in listed} == {
        ("trash", trash), ("outputs", old), ("run folder", finished)
    }  # fmt: skip
    assert {i.path: i.size for i in listed}[old] == 5000
    # The dry run (the default) shows them and their sizes, and removes nothing: the command
    # as a user runs it (in this process, the console's width is whatever it was at import).
    done = imageops("gc", cwd=project.project_root)
    assert done.returncode == 0, done.stderr
    shown = done.stdout
    assert finished_id in shown and old.name in shown and "5.0 kB" in shown
    assert "nothing removed" in shown
    assert finished.is_dir() and old.is_dir() and trash.is_dir()

    shown = _gc("--yes")
    assert "removed 3 of 3" in shown
    assert not finished.exists() and not old.exists() and not trash.exists()
    assert failed.is_dir() and killed.is_dir() and new.is_dir()  # unfinished runs resume
    assert sorted(p.name for p in project.runs_dir.iterdir()) == sorted([failed.name, killed.name])
    assert "nothing to reclaim" in _gc()
    # A younger outputs folder goes once the age asked for is shorter.
    assert _paths(project) == []
    assert [i.path for i in list_reclaimable(project, 0.0)] == [new]


# --- imageops gc: what it never removes -------------------------------------------------------


def test_gc_never_removes_a_job_being_trained(
    project: Settings, untrained: Path, digits_split: tuple[Path, Path]
) -> None:
    run_id, run_dir = _run(project, "FINISHED")  # e.g. trained again under its run id
    outputs = project.outputs_dir / "train-20250101-120000"  # the train flow's
    (outputs / "untrained").mkdir(parents=True)
    pipeline = project.outputs_dir / "20250101-120000-digits-abcd1234"  # a pipeline's
    (pipeline / "model").mkdir(parents=True)
    _age(pipeline)
    request = TrainRequest(
        model=untrained, train_data=digits_split[0], val_data=digits_split[1],
        out=outputs / "model", params={**FAST, "precision": "fp32"}, transform=PRE,
    )  # fmt: skip
    # A pipeline holds its data set from convert to its last step (exporting, scoring, ...).
    with launch_lock(run_dir, run_id), dataset_lock(project, "digits"):
        # What the launcher writes under its lock: the run's config, naming where its model goes.
        check_request(request, project).bind(run_id, run_dir).save(run_dir / CONFIG)
        _age(outputs)
        assert _paths(project) == []
        assert "nothing to reclaim" in _gc("--yes")
        assert run_dir.is_dir() and outputs.is_dir() and pipeline.is_dir()
    # Once the launcher and the pipeline have let go, all three may go.
    assert set(_paths(project)) == {run_dir, outputs, pipeline}


def test_gc_keeps_a_job_that_starts_while_it_removes(project: Settings) -> None:
    run_id, run_dir = _run(project, "FINISHED")
    (item,) = list_reclaimable(project, 7.0)
    with launch_lock(run_dir, run_id):  # a launcher took the run after the listing
        assert item.remove() is False
    assert run_dir.is_dir()
    assert item.remove() is True and not run_dir.exists()


def test_gc_reclaims_a_killed_promotions_folder_never_a_running_one_or_a_decision(
    project: Settings,
) -> None:
    root = project.home_dir / PROMOTIONS_DIR
    killed = root / "20250101-120000-000000-v3"  # v3 scored, then killed before its decision
    (killed / ".imageops-shards").mkdir(parents=True)
    (killed / "v3.csv").write_bytes(b"s" * 3000)
    decided = root / "20250101-130000-000000-v4"  # the record of a decision
    decided.mkdir()
    (decided / DECISION_FILE).write_text("{}")
    running = RegistryError("a promotion runs")
    # A promotion holds its lock from its folder's creation to its decision: while one runs,
    # a folder without a decision may be its own.
    with holding(promotion_lock(project), 0, running):
        assert _paths(project) == []
    (item,) = list_reclaimable(project, 7.0)
    assert (item.kind, item.path, item.size) == ("partial promotion", killed, 3000)
    with holding(promotion_lock(project), 0, running):  # one started after the listing
        assert item.remove() is False
    assert killed.is_dir()
    assert "removed 1 of 1" in _gc("--yes")
    assert sorted(root.iterdir()) == [decided]


@pytest.mark.slow
def test_gc_keeps_registered_versions_and_aliased_cache_entries(
    project: Settings, exported_model: Path
) -> None:
    register(exported_model, settings=project, alias="champion")  # v1, the champion
    register(exported_model, settings=project)  # v2, no alias
    for uri in (f"models:/{NAME}@champion", f"models:/{NAME}/2"):
        fetch_registered_model(uri, project)
    v1, v2 = cache_path(project, NAME, 1), cache_path(project, NAME, 2)
    v1_files = {p.name: p.read_bytes() for p in v1.iterdir()}

    assert _paths(project) == [v2]
    assert "removed 1 of 1" in _gc("--yes")
    assert not v2.exists()
    assert {p.name: p.read_bytes() for p in v1.iterdir()} == v1_files  # the alias's, untouched
    # What the registered versions themselves refer to (MLflow's artifacts) was never touched:
    # v2 downloads again, whole, matching its registered sha256.
    again = fetch_registered_model(f"models:/{NAME}/2", project)
    tags = MlflowClient(project.tracking_uri).get_model_version(NAME, "2").tags
    assert sha256_file(again.path / "model.onnx") == tags["onnx_sha256"]
    # Once the alias moves to v2, v1's cache entry is the one gc may reclaim.
    MlflowClient(project.tracking_uri).set_registered_model_alias(NAME, "champion", "2")
    assert _paths(project) == [v1]


@pytest.mark.slow
def test_gc_keeps_a_cache_entry_a_scoring_reads_until_it_ends(
    project: Settings,
    exported_model: Path,
    digits_split: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    register(exported_model, settings=project)  # v1, no alias: its cache entry may go
    # Held as `imageops score models:/...` holds it, from the fetch to the scored table.
    with model_in_use(f"models:/{NAME}/1", project) as model_dir:
        assert _paths(project) == [model_dir]  # listed: once the scoring ends it may go
        shown = _gc("--yes")
        assert f"kept {model_dir}: in use now" in shown.replace("\n", "")
        assert "removed 0 of 1" in shown
        assert score(model_dir, digits_split[1], tmp_path / "scored.csv").is_file()
    assert "removed 1 of 1" in _gc("--yes") and not model_dir.exists()

    # A gc between a flow's fetch and its lease: the lease fetches the same version again.
    cached = fetch_registered_model(f"models:/{NAME}/1", project)
    trash(cached.path)
    with leased(cached, project) as again:
        assert again == cached and (again.path / "model.onnx").is_file()
    # While gc holds the entry alone a reader waits (here 0.2 s), then says who holds it.
    monkeypatch.setattr("tasks.registry.model_uri.LOCK_TIMEOUT_S", 0.2)
    with (
        holding(lease_path(cached.path), 0, RegistryError("gc")),
        pytest.raises(RegistryError, match="imageops gc"),
        leased(cached, project),
    ):
        pass


def _git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def git_author(monkeypatch: pytest.MonkeyPatch) -> None:
    """Who the tests' git commits are by (the machine may have no git identity)."""
    for var in ("GIT_AUTHOR", "GIT_COMMITTER"):
        monkeypatch.setenv(f"{var}_NAME", "imageops tests")
        monkeypatch.setenv(f"{var}_EMAIL", "tests@example.org")


def _cache_file(settings: Settings, md5: str) -> Path:
    return settings.project_root / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]


@pytest.mark.slow
def test_gc_keeps_dvc_cache_a_committed_or_workspace_dvc_file_refers_to(
    project: Settings, digits_split: tuple[Path, Path], git_author: None
) -> None:
    root = project.project_root
    _git("init", "-q", cwd=root)
    (root / ".gitignore").write_text(".imageops/\n")
    data = root / "data" / "train"
    shutil.copytree(digits_split[0], data)
    (data / MANIFEST).unlink()  # a folder, not an ImageDirectory: extra.bin is no stray
    committed = version(data, project)
    _git("add", "-A", cwd=root)
    _git("commit", "-q", "-m", "data v1", cwd=root)
    # Two more versions, neither committed: the last is the work tree's, the middle one nobody's.
    (data / "extra.bin").write_bytes(b"middle version only")
    middle = version(data, project)
    (data / "extra.bin").write_bytes(b"the work tree's version")
    current = version(data, project)
    assert len({committed, middle, current}) == 3

    (item,) = list_reclaimable(project, 7.0)
    assert item.kind == "DVC cache" and "2 objects" in item.reason  # the .dir and extra.bin
    assert _cache_file(project, middle).is_file()
    assert "removed 1 of 1" in _gc("--yes")
    assert not _cache_file(project, middle).exists()
    assert _cache_file(project, committed).is_file() and _cache_file(project, current).is_file()
    # Both kept versions check out whole: the work tree's, then the committed one.
    from dvc.repo import Repo

    shutil.rmtree(data)
    with Repo(str(root)) as repo:
        repo.checkout(force=True)
    assert (data / "extra.bin").read_bytes() == b"the work tree's version"
    _git("checkout", "-q", "HEAD", "--", "data/train.dvc", cwd=root)
    shutil.rmtree(data)
    with Repo(str(root)) as repo:
        repo.checkout(force=True)
    assert not (data / "extra.bin").exists()
    expected = sorted(
        p.relative_to(digits_split[0]) for p in digits_split[0].rglob("*") if p.name != MANIFEST
    )
    assert sorted(p.relative_to(data) for p in data.rglob("*")) == expected
    # The version no .dvc file refers to any more is what gc may reclaim now.
    (item,) = list_reclaimable(project, 7.0)
    assert "2 objects" in item.reason


@pytest.mark.slow
def test_gc_keeps_dvc_cache_a_dvc_file_on_another_branch_or_a_tag_refers_to(
    project: Settings, git_author: None
) -> None:
    from dvc.repo import Repo

    root = project.project_root
    _git("init", "-q", "-b", "main", cwd=root)
    (root / ".gitignore").write_text(".imageops/\n")
    ensure_dvc_repo(project).close()
    _git("add", "-A", cwd=root)
    _git("commit", "-q", "-m", "start", cwd=root)
    # data/kv4 versioned and committed on two branches off main, never on main itself; then
    # one branch is tagged and deleted: the tag alone names its version.
    data = root / "data" / "kv4"
    md5 = {}
    for ref in ("branch", "tagged"):
        _git("checkout", "-q", "-b", ref, "main", cwd=root)
        shutil.rmtree(data, ignore_errors=True)
        data.mkdir(parents=True)
        (data / "image.png").write_bytes(f"data/kv4 on {ref}".encode())
        md5[ref] = version(data, project)
        _git("add", "-A", cwd=root)
        _git("commit", "-q", "-m", f"data/kv4 on {ref}", cwd=root)
    _git("tag", "kv4-v1", "tagged", cwd=root)
    _git("checkout", "-q", "main", cwd=root)
    _git("branch", "-q", "-D", "tagged", cwd=root)
    shutil.rmtree(data)

    assert _paths(project) == []
    assert "nothing to reclaim" in _gc("--yes")
    # The branch's and the tag's versions check out whole from the cache alone (no pull).
    for ref, made_on in (("branch", "branch"), ("kv4-v1", "tagged")):
        assert _cache_file(project, md5[made_on]).is_file()
        _git("checkout", "-q", ref, cwd=root)
        with Repo(str(root)) as repo:
            repo.checkout(force=True)
        assert (data / "image.png").read_bytes() == f"data/kv4 on {made_on}".encode()
