"""Data versioning with a real DVC repository in a throw-away project, with and without git."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from models.locks import holding
from tasks.data.datasets import folder_lock_path
from tasks.data.imagedir import MANIFEST
from tasks.data.split import split
from tasks.data.versioning import LOCK_FILE, REMOTE_NAME, ensure_dvc_repo, uncommitted, version
from tasks.shared.errors import VersioningError, VersionMismatchError
from tasks.shared.settings import Settings


def _data(settings: Settings, source: Path, name: str = "train") -> Path:
    """A copy of an ImageDirectory under the project's data folder."""
    dest = settings.data_path / name
    shutil.copytree(source, dest)
    return dest


def _rewrite(data: Path, source: Path) -> None:
    """``data`` replaced by a copy of another ImageDirectory, as a step writing it would."""
    shutil.rmtree(data)
    shutil.copytree(source, data)


def _remote_objects(settings: Settings) -> set[str]:
    """Content hashes in the remote, as DVC 3 lays them out (files/md5/ab/cdef...)."""
    root = Path(settings.dvc_remote) / "files" / "md5"
    return {p.parent.name + p.name for p in root.rglob("*") if p.is_file()}


def _git_init(folder: Path) -> None:
    subprocess.run(["git", "init", "-q", str(folder)], check=True)


def test_version_without_git_pushes_and_returns_the_md5(
    project: Settings, digits_split: tuple[Path, Path]
) -> None:
    data = _data(project, digits_split[0])

    md5 = version(data, project)

    assert md5.endswith(".dir") and len(md5) == 32 + len(".dir")
    out = yaml.safe_load((data.parent / "train.dvc").read_text())["outs"][0]
    assert out["md5"] == md5 and out["path"] == "train"
    n_files = sum(1 for p in data.rglob("*") if p.is_file())
    assert out["nfiles"] == n_files == 73  # 72 images and the manifest
    # The remote holds the directory listing and every file, and nothing else.
    assert md5 in _remote_objects(project)
    assert len(_remote_objects(project)) == n_files + 1
    assert not (project.project_root / ".git").exists()
    assert (project.project_root / ".dvc").is_dir()


def test_version_in_git_gives_the_same_md5_and_gitignores_the_data(
    project: Settings, digits_split: tuple[Path, Path]
) -> None:
    _git_init(project.project_root)
    data = _data(project, digits_split[0])

    first = version("data/train", project)  # relative to the project root
    again = version(data, project)

    assert first == again
    assert (data.parent / ".gitignore").read_text().splitlines() == ["/train"]
    staged = subprocess.run(
        ["git", "status", "--porcelain"],
        cwd=project.project_root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "A  .dvc/config" in staged  # DVC initialised inside git and staged its files
    assert ".dvc/config.local" not in staged  # machine-local settings stay out of git


def test_unchanged_data_keeps_its_md5_and_changed_data_gets_a_new_one(
    project: Settings, digits_split: tuple[Path, Path]
) -> None:
    data = _data(project, digits_split[1])

    first = version(data, project)
    pushed = _remote_objects(project)
    second = version(data, project)
    assert second == first
    assert _remote_objects(project) == pushed

    _rewrite(data, digits_split[0])
    third = version(data, project)
    assert third != first
    assert third in _remote_objects(project)
    assert first in _remote_objects(project)  # the old version is still in the remote


def test_ensure_dvc_repo_is_idempotent_and_configures_the_local_remote(
    project: Settings,
) -> None:
    with ensure_dvc_repo(project) as repo:
        assert Path(repo.root_dir) == project.project_root.resolve()
    config = project.project_root / ".dvc" / "config.local"
    written = config.read_text()
    stamp = config.stat().st_mtime_ns

    with ensure_dvc_repo(project) as repo:
        remote = repo.config["remote"][REMOTE_NAME]["url"]
        assert repo.config["core"]["remote"] == REMOTE_NAME
        assert repo.config["core"]["analytics"] is False

    assert remote == str(project.home_dir / "dvc-remote")
    assert config.read_text() == written and config.stat().st_mtime_ns == stamp
    assert f'remote "{REMOTE_NAME}"' in written
    shared = (project.project_root / ".dvc" / "config").read_text()
    assert shared.split() == ["[core]", "no_scm", "=", "True", "[cache]", "type", "=",
                              '"reflink,hardlink,copy"']  # fmt: skip


def test_parallel_versions_wait_for_each_other(
    project: Settings, digits_split: tuple[Path, Path]
) -> None:
    # Two DVC commands at once in one repository fail on DVC's lock; ours serialises them.
    train = _data(project, digits_split[0], "train")
    val = _data(project, digits_split[1], "val")

    with ThreadPoolExecutor(max_workers=2) as pool:
        md5s = list(pool.map(lambda p: version(p, project), [train, val]))

    assert md5s[0] != md5s[1]
    assert set(md5s) <= _remote_objects(project)


def test_version_waits_while_another_step_holds_the_dvc_lock(
    project: Settings, digits_split: tuple[Path, Path]
) -> None:
    data = _data(project, digits_split[1])

    with ThreadPoolExecutor(max_workers=1) as pool:
        # Held as another imageops process would hold it.
        with holding(project.home_dir / LOCK_FILE, 0, VersioningError("held", "")):
            pending = pool.submit(version, data, project)
            time.sleep(1.0)
            assert not pending.done()
            assert not (project.project_root / ".dvc").exists()  # DVC not touched yet
        md5 = pending.result(timeout=120)

    assert md5 in _remote_objects(project)


def test_uncommitted_names_what_git_lacks_relative_to_a_project_in_a_git_subfolder(
    project: Settings, digits_split: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The project is a folder inside a larger git repository (DVC's subdir repository).
    outer = project.project_root.parent
    _git_init(outer)
    monkeypatch.setenv("GIT_AUTHOR_NAME", "t")
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "t@example.org")
    monkeypatch.setenv("GIT_COMMITTER_NAME", "t")
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", "t@example.org")
    data = _data(project, digits_split[1], "val")

    version(data, project)

    pending = uncommitted([data], project)
    assert pending == [".dvc/config", ".dvc/.gitignore", ".dvcignore", "data/val.dvc",
                       "data/.gitignore"]  # fmt: skip
    with ensure_dvc_repo(project) as repo:
        assert repo.config["core"]["autostage"] is True  # so DVC staged them
    subprocess.run(["git", "commit", "-q", "-m", "data"], cwd=outer, check=True)
    assert uncommitted([data], project) == []

    _rewrite(data, digits_split[0])  # a new version: only its pointer changes
    version(data, project)
    assert uncommitted([data], project) == ["data/val.dvc"]


def test_uncommitted_is_empty_outside_git(project: Settings, digits_split: tuple[Path, Path]):
    data = _data(project, digits_split[1], "val")
    version(data, project)
    assert uncommitted([data], project) == []


def test_a_path_outside_the_project_is_refused(project: Settings, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "x.txt").write_text("x")

    with pytest.raises(VersioningError, match="not inside the project root"):
        version(outside, project)
    with pytest.raises(VersioningError, match="not inside the project root"):
        version(project.project_root, project)
    with pytest.raises(VersioningError, match="does not exist"):
        version("data/missing", project)
    assert not (project.project_root / ".dvc").exists()  # refused before DVC was touched


def test_an_existing_repo_links_from_its_cache_unless_its_user_chose(
    project: Settings, digits_split: tuple[Path, Path]
) -> None:
    from tests.projects import dvc

    root = project.project_root
    assert dvc("init", "--no-scm", "-q", cwd=root).returncode == 0  # a repo imageops did not make
    with ensure_dvc_repo(project) as repo:
        assert repo.config["cache"]["type"] == ["reflink", "hardlink", "copy"]
    # Where `dvc config` writes, so that a type the user sets later replaces imageops' one.
    assert 'type = "reflink,hardlink,copy"' in (root / ".dvc" / "config").read_text()
    assert "cache" not in (root / ".dvc" / "config.local").read_text()

    # A type the user set is theirs: `copy` keeps the data and the cache apart.
    assert dvc("config", "cache.type", "copy", cwd=root).returncode == 0
    data = _data(project, digits_split[1])
    version(data, project)
    image = next(data.rglob("*.png"))
    cached = [p for p in (root / ".dvc" / "cache").rglob("*") if p.is_file()]
    assert not any(p.samefile(image) for p in cached)
    assert "type = copy" in (root / ".dvc" / "config").read_text()


ROUNDS = 6  # of a split and a version at once
WAITING = "waiting for another imageops step using"  # what a step waiting for a folder logs


def _pushed_disagreement(settings: Settings, md5: str) -> str | None:
    """How the pushed folder ``md5`` disagrees with the manifest.json pushed in it, or None."""
    objects = Path(settings.dvc_remote) / "files" / "md5"
    listing = json.loads((objects / md5[:2] / md5[2:]).read_text())
    files = {item["relpath"]: item["md5"] for item in listing}
    manifest = files.pop(MANIFEST)
    listed = json.loads((objects / manifest[:2] / manifest[2:]).read_text())["images"]
    paths = {image["path"] for image in listed}
    if paths == set(files):
        return None
    return f"{md5}: {len(files)} files, its manifest lists {len(paths)}"


def test_a_version_never_mixes_two_splits_of_its_folder(
    project: Settings, digits_split: tuple[Path, Path]
) -> None:
    # Split rewrites train while version adds it (issue 43: a pushed version held files of two
    # splits). Each version starts as a split ends and the next one starts: they overlap every
    # round, and each version must be one split, whole.
    images = _data(project, digits_split[0], "images")
    train, val = images.parent / "train", images.parent / "val"
    split(images, train, val, fraction=0.5, seed=0)
    split_done, stop = threading.Event(), threading.Event()

    def resplit() -> int:
        seed = 0
        while not stop.is_set():
            seed += 1
            split(images, train, val, fraction=0.5, seed=seed)
            split_done.set()
        return seed

    md5s = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        splitting = pool.submit(resplit)
        try:
            for _ in range(ROUNDS):
                assert split_done.wait(timeout=60)
                split_done.clear()
                md5s.append(version(train, project))
        finally:
            stop.set()
        assert splitting.result() > ROUNDS

    problems = [p for md5 in set(md5s) if (p := _pushed_disagreement(project, md5))]
    assert problems == []
    assert len(set(md5s)) > 1  # versions of several splits were taken


def test_version_waits_for_a_process_holding_the_folder_and_not_after_it_is_killed(
    project: Settings, digits_split: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    # Steps run as processes of their own (the CLI); a killed holder frees the folder (flock).
    caplog.set_level(logging.INFO, logger="tasks.shared.project_lock")
    data = _data(project, digits_split[1])
    lock = folder_lock_path(project, data)
    lock.parent.mkdir(parents=True, exist_ok=True)
    hold = "import sys, time; from filelock import FileLock; lock = FileLock(sys.argv[1]); "
    hold += "lock.acquire(); "
    holder = subprocess.Popen(
        [sys.executable, "-c", hold + "print('held', flush=True); time.sleep(120)", str(lock)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(version, data, project)
            while WAITING not in caplog.text and not pending.done():
                time.sleep(0.05)
            assert WAITING in caplog.text
            assert not pending.done()
            assert not (data.parent / "train.dvc").exists()  # nothing added yet
            holder.kill()
            md5 = pending.result(timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert md5 in _remote_objects(project)


def test_a_folder_whose_files_differ_from_its_manifest_is_neither_recorded_nor_pushed(
    project: Settings, digits_split: tuple[Path, Path]
) -> None:
    _git_init(project.project_root)
    data = _data(project, digits_split[0])
    version(data, project)
    git = ["git", "-C", str(project.project_root)]
    recorded = {f: f.read_bytes() for f in (data.parent / "train.dvc", data.parent / ".gitignore")}
    staged = subprocess.run([*git, "ls-files", "--stage"], capture_output=True, text=True).stdout
    pushed = _remote_objects(project)
    # A file the manifest does not list, and a listed image gone: not the folder it describes.
    images = sorted(data.rglob("*.png"))
    shutil.copy(images[0], images[0].with_name("stray.png"))
    images[1].unlink()

    with pytest.raises(VersionMismatchError, match=r"1 listed images missing.*1 files not listed"):
        version(data, project)

    assert {f: f.read_bytes() for f in recorded} == recorded  # the last version's pointer
    after = subprocess.run([*git, "ls-files", "--stage"], capture_output=True, text=True).stdout
    assert after == staged
    assert _remote_objects(project) == pushed


def test_dvc_warnings_reach_the_stderr_of_now_not_one_closed_since() -> None:
    """DVC binds its log handlers to the stderr of the moment dvc is imported; once that one is
    closed (pytest's capture, a daemon's redirect), its next warning failed the step with
    LoggingException (seen: a fetch of a missing version, in the full suite)."""
    script = (
        "import logging, sys, tempfile\n"
        "kept, sys.stderr = sys.stderr, open(tempfile.mktemp(), 'w')\n"
        "import dvc.repo\n"
        "sys.stderr.close(); sys.stderr = kept\n"
        "from tasks.data.dvc_logs import quiet_dvc_logs\n"
        "quiet_dvc_logs()\n"
        "logging.getLogger('dvc_data.index.fetch').warning('missing cache files')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "missing cache files" in done.stderr and "Logging error" not in done.stderr
