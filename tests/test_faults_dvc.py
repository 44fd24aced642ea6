"""`imageops version` killed mid-way: the next one finishes it, nothing lost, nothing redone.

The kills are real: the CLI runs in its own session, the test polls the DVC cache (then the remote)
every 10 ms, freezes the process group with SIGSTOP once objects are arriving, looks at what is on
disk and kills the group with SIGKILL. The reference is an undisturbed `version` of an identical
copy of the data in a second project. The states a kill leaves only within a few microseconds
(between DVC's truncate and write of a small file, or inside `dvc init`) are built as it leaves
them, since no test can hit such a window on purpose.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from server_processes import ROOT, Processes

from tasks.data.versioning import ensure_dvc_repo, version
from tasks.shared.settings import Settings

POLL_SECONDS = 0.01
# Objects that must be whole in the cache (or the remote) before the kill: enough to check that
# they are not copied again, few enough to be reached long before the step ends.
SEEN_BEFORE_THE_KILL = 50


@pytest.fixture(scope="module")
def digits_600(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ImageDirectory of 600 real digits at 8x8, 60 a class. Read only.

    Files, not bytes, are what DVC's add and push take time over: 600 keep each busy for longer
    than the 10 ms poll needs to catch it mid-way, even on a fast machine.
    """
    from tasks.data.convert import convert
    from tasks.data.sample import write_digits

    root = tmp_path_factory.mktemp("digits-600")
    convert(write_digits(root / "raw", size=8, per_class=60), root / "images", workers=1)
    return root / "images"


def _objects(store: Path) -> dict[str, os.stat_result]:
    """The whole objects of a DVC cache or remote (``files/md5``), by hash, with their stat.

    A transfer writes ``.<random>.tmp`` and renames it to the hash: a name without a dot is an
    object, and the temporary files a kill leaves behind are not.
    """
    root = store / "files" / "md5"
    if not root.is_dir():
        return {}
    return {
        p.parent.name + p.name: p.stat()
        for p in root.glob("*/*")
        if p.is_file() and not p.name.startswith(".")
    }


# `imageops version data/images`, as a user runs it (the path is relative to the project root).
VERSION = [sys.executable, "-m", "app.cli", "version", "data/images"]


def _kill_version_while_filling(
    procs: Processes, name: str, store: Path, inspect: Callable[[], None]
) -> None:
    """Start `imageops version` in its own session; once objects arrive in ``store``, freeze its
    process group, ``inspect()`` the disk, and kill the group."""
    proc = procs.start(name, VERSION, os.environ | {"PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 180
    try:
        while len(_objects(store)) < SEEN_BEFORE_THE_KILL:
            if proc.poll() is not None:
                pytest.fail(f"version ended before the kill\n{procs.report()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no objects arrived in {store}\n{procs.report()}")
            time.sleep(POLL_SECONDS)
        os.killpg(proc.pid, signal.SIGSTOP)
        inspect()
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have ended on its own
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def _same_file(before: os.stat_result, after: os.stat_result) -> bool:
    return (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


def test_a_version_killed_in_dvc_add_then_in_dvc_push_is_finished_by_the_next(
    project: Settings, digits_600: Path, tmp_path: Path
) -> None:
    from dvc.repo import Repo

    data = project.data_path / "images"
    shutil.copytree(digits_600, data)
    n_objects = sum(1 for p in data.rglob("*") if p.is_file()) + 1  # and the .dir listing
    dvc_file = project.data_path / "images.dvc"
    cache = project.project_root / ".dvc" / "cache"
    remote = Path(project.dvc_remote)
    seen: dict[str, dict[str, os.stat_result]] = {}

    def mid_add() -> None:
        seen["cache"] = _objects(cache)
        assert len(seen["cache"]) < n_objects, "the add had finished: no kill mid-way"
        assert not dvc_file.exists() and not _objects(remote)
        holders = json.loads((project.project_root / ".dvc" / "tmp" / "rwlock").read_text())
        # DVC's lock on the data, held by a process about to die
        assert [Path(held).name for held in holders["write"]] == ["images"]

    def mid_push() -> None:
        seen["remote"] = _objects(remote)
        assert len(seen["remote"]) < n_objects, "the push had finished: no kill mid-way"
        assert len(_objects(cache)) == n_objects and dvc_file.exists()  # the add got done first

    # A linked add (imageops' default) is over in milliseconds, too soon for a kill to land in
    # it; a copying one (a type the user may choose) takes the time, and leaves half copies.
    with ensure_dvc_repo(project) as repo, repo.config.edit("repo") as conf:
        conf["cache"]["type"] = "copy"
    procs = Processes(tmp_path / "logs")
    _kill_version_while_filling(procs, "killed-in-add", cache, mid_add)
    _kill_version_while_filling(procs, "killed-in-push", remote, mid_push)
    done = subprocess.run(
        VERSION,
        cwd=project.project_root,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    md5 = done.stdout.split()[0].rpartition("@")[2]  # images@<md5>

    # The undisturbed run, on an identical copy in a project of its own.
    other = tmp_path / "reference"
    reference = Settings(project_root=other, home=other / ".imageops")
    shutil.copytree(digits_600, reference.data_path / "images")
    assert version(reference.data_path / "images", reference) == md5
    assert yaml.safe_load(dvc_file.read_text()) == yaml.safe_load(
        (reference.data_path / "images.dvc").read_text()
    )
    in_cache, in_remote = _objects(cache), _objects(remote)
    assert set(in_cache) == set(in_remote) == set(_objects(Path(reference.dvc_remote)))
    assert len(in_cache) == n_objects
    # Every object is whole (DVC trusts a name it finds); none finished before a kill was redone.
    for oid in in_cache:
        body = (cache / "files" / "md5" / oid[:2] / oid[2:]).read_bytes()
        assert hashlib.md5(body).hexdigest() == oid.removesuffix(".dir")
    assert all(_same_file(stat, in_cache[oid]) for oid, stat in seen["cache"].items())
    assert all(_same_file(stat, in_remote[oid]) for oid, stat in seen["remote"].items())

    with Repo(str(project.project_root)) as repo:
        assert repo.status() == {}  # the data is what the .dvc file says
        assert repo.status(cloud=True) == {}  # and the remote has all of it
        status = repo.data_status(not_in_remote=True, remote_refresh=True)
    assert status["not_in_cache"] == status["not_in_remote"] == []
    assert not status["committed"] and not status["uncommitted"]
    holders = json.loads((project.project_root / ".dvc" / "tmp" / "rwlock").read_text())
    assert not any(holders.values())  # the dead processes' locks are gone


@pytest.mark.parametrize("path", [".dvc/tmp/rwlock", "data/val.dvc", ".dvc/config.local"])
def test_a_file_that_a_kill_left_empty_is_rewritten(
    project: Settings, digits_split: tuple[Path, Path], path: str
) -> None:
    # DVC and configobj rewrite these in place: open (truncating), then one write.
    data = project.data_path / "val"
    shutil.copytree(digits_split[1], data)
    md5 = version(data, project)
    written = (project.project_root / path).read_text()

    (project.project_root / path).write_text("")

    assert version(data, project) == md5
    assert (project.project_root / path).read_text() == written


@pytest.mark.parametrize("git", [False, True], ids=["no-git", "git"])
def test_a_dvc_init_cut_short_by_a_kill_is_started_again(
    project: Settings, digits_split: tuple[Path, Path], git: bool
) -> None:
    root = project.project_root
    if git:
        subprocess.run(["git", "init", "-q", str(root)], check=True)
    # Repo.init makes .dvc/, then an empty config, then writes no_scm into it (without git).
    (root / ".dvc").mkdir()
    if not git:
        (root / ".dvc" / "config").write_text("")
    data = project.data_path / "val"
    shutil.copytree(digits_split[1], data)

    md5 = version(data, project)

    assert (data.parent / "val.dvc").is_file() and md5 in _objects(Path(project.dvc_remote))
    assert (root / ".dvcignore").is_file()
    if git:
        staged = subprocess.run(
            ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True
        ).stdout
        assert "A  .dvc/config" in staged and "A  .dvcignore" in staged
    else:
        assert (root / ".dvc" / "config").read_text().split() == [
            "[core]", "no_scm", "=", "True", "[cache]", "type", "=", '"reflink,hardlink,copy"'
        ]  # fmt: skip
