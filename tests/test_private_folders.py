"""The stacks' state is their owner's alone: folders made or tightened to 0700 before any server
starts, Ray's 0777 sessions inside one, servers' files owner-only, another user's folder refused.

In-process and on real folders; the running stacks are checked in tests/test_stack.py and
tests/test_team.py (``test_..._state_is_open_to_no_other_user``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import pytest
from file_modes import open_to_others

from app.team import ray_temp_dir
from tasks.shared import servers
from tasks.shared.errors import StateFolderError
from tasks.shared.private_folders import private_folder, private_tree

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="gives a folder to another user")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def short_ray_folder(deep: Path) -> Path:
    """The folder under /tmp that a deep project's Ray folder links to (its name is known)."""
    digest = hashlib.sha256(str(deep).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"imageops-ray-{digest}"


def test_a_state_folder_is_made_or_tightened_owner_only(tmp_path: Path) -> None:
    made = private_folder(tmp_path / "new" / "home")
    assert mode(made) == 0o700
    older = tmp_path / "older"
    older.mkdir(mode=0o777)
    older.chmod(0o777)
    (older / "mlflow.db").write_text("")
    (older / "mlflow.db").chmod(0o644)
    me = os.geteuid()
    assert open_to_others(older) == [
        f"{older} (777, uid {me})",
        f"{older}/mlflow.db (644, uid {me})",
    ]
    private_folder(older)
    assert mode(older) == 0o700 and open_to_others(older) == []


def test_as_root_postgres_passes_through_to_its_folder_and_reaches_nothing_else(
    tmp_path: Path,
) -> None:
    home, group = tmp_path / "home", os.getegid() + 1  # a group that is not ours
    for folder in ("team/postgres", "team/logs", "runs"):
        (home / folder).mkdir(parents=True)
        (home / folder).chmod(0o755)
    (home / "mlflow.db").write_text("")
    (home / "mlflow.db").chmod(0o644)
    if os.geteuid() != 0:
        group = os.getegid()  # the one group an ordinary user may give
    private_tree(home, passage=home / "team" / "postgres", group=group)
    for folder in (home, home / "team"):
        assert mode(folder) == 0o710 and folder.stat().st_gid == group
    assert mode(home / "team" / "postgres") == 0o755  # PostgreSQL's own: initdb makes it 0700
    assert mode(home / "team" / "logs") == mode(home / "runs") == 0o700
    assert mode(home / "mlflow.db") == 0o600


@as_root
def test_a_folder_or_link_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(
        StateFolderError, match=f"{theirs} is to hold a server's state.*uid {NOBODY}"
    ):
        private_folder(theirs)
    link = tmp_path / "link"
    link.symlink_to(private_folder(tmp_path / "ours"))
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(StateFolderError, match=f"a link of uid {NOBODY}"):
        private_folder(link)
    (tmp_path / "file").write_text("")
    with pytest.raises(StateFolderError, match="not a folder"):
        private_folder(tmp_path / "file")


def test_ray_sessions_are_inside_an_owner_only_folder_short_or_linked(tmp_path: Path) -> None:
    """Ray makes its --temp-dir and sessions 0777: the folder holding it is 0700, whether it is
    the project's (a short path) or the short one under /tmp that a deep project links to."""
    short_project = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
    deep = tmp_path / "a-deep-project-folder" / ".imageops" / "team" / "ray"
    linked = short_ray_folder(deep)
    try:
        for folder in (short_project / "ray", deep):
            temp = ray_temp_dir(folder)
            assert len(str(temp)) <= 40
            temp.mkdir(mode=0o777)
            temp.chmod(0o777)  # what Ray does, sockets and all
            assert mode(temp.parent) == 0o700 and temp.parent.stat().st_uid == os.geteuid()
            assert open_to_others(folder) == [], folder
        assert deep.resolve() == linked
        linked.chmod(0o777)  # left so by an older imageops
        ray_temp_dir(deep)
        assert mode(linked) == 0o700
    finally:
        shutil.rmtree(short_project)
        shutil.rmtree(linked, ignore_errors=True)


@as_root
def test_a_short_ray_folder_planted_by_another_user_is_refused(tmp_path: Path) -> None:
    deep = tmp_path / "a-deep-project-folder" / ".imageops" / "team-join" / "ray"
    planted = short_ray_folder(deep)
    planted.mkdir(mode=0o777)
    try:
        os.chown(planted, NOBODY, NOBODY)
        with pytest.raises(StateFolderError, match=str(planted)):
            ray_temp_dir(deep)
    finally:
        planted.rmdir()


def test_a_server_started_private_makes_owner_only_files(tmp_path: Path) -> None:
    script = "open('made', 'w').close()"
    for private, expected in ((True, 0o600), (False, 0o666 & ~_umask())):
        folder = tmp_path / str(private)
        folder.mkdir()
        process = servers.start([sys.executable, "-c", script], folder / "log", dict(os.environ),
                                cwd=folder, private=private)  # fmt: skip
        assert process.wait(timeout=30) == 0
        assert mode(folder / "made") == expected


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current
