"""A disk that fills up while a step writes: a named error and what to do, never a traceback, and
nothing half-written left that looks whole.

Each test writes onto a real full disk: a small tmpfs mounted for the test and filled to the brim
(root only; elsewhere the tests say why they skip). The steps are run as a user runs them, with
the ``imageops`` command.
"""

from __future__ import annotations

import contextlib
import errno
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from model_helpers import copy_model
from projects import imageops

from models.directory import ONNX
from models.errors import DiskFullError, disk_full
from tasks.data.dvc_repairs import nothing_half_done
from tasks.data.versioning import ensure_dvc_repo, version
from tasks.shared.step import _retry_unless_user_error

pytest_plugins = ["model_fixtures"]


@contextmanager
def tmpfs_at(folder: Path) -> Iterator[Path]:
    """A 160 MiB tmpfs (room for a resnet18 ModelDirectory) mounted on ``folder`` for the block;
    the test skips, saying why, where mounting is not allowed (root only)."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=160m", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root only): {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs for the test to put its inputs on and then :func:`fill`."""
    with tmpfs_at(tmp_path / "disk") as disk:
        yield disk


def fill(disk: Path, leave: int = 0) -> None:
    """Take every free byte of ``disk`` but ``leave``."""
    with (disk / "filler").open("ab") as filler:
        filler.write(b"\0" * max(0, shutil.disk_usage(disk).free - leave - (1 << 20)))
        filler.flush()
        with contextlib.suppress(OSError):
            while shutil.disk_usage(disk).free > leave:
                filler.write(b"\0" * 4096)
                filler.flush()
    assert shutil.disk_usage(disk).free == leave


def assert_named_disk_full(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "error: DiskFullError: no space left on" in done.stderr, done.stderr
    assert "what to do: Free space on that disk" in done.stderr, done.stderr


def left_on(disk: Path) -> list[str]:
    return sorted(p.relative_to(disk).as_posix() for p in disk.rglob("*") if p.name != "filler")


def test_convert_onto_a_full_disk_says_so_and_leaves_nothing(
    full_disk: Path, digits_raw: Path, tmp_path: Path
) -> None:
    fill(full_disk)
    done = imageops("convert", str(digits_raw), str(full_disk / "images"), cwd=tmp_path)
    assert_named_disk_full(done)
    assert left_on(full_disk) == []  # no images folder, no temporary one


def test_export_and_score_onto_a_full_disk_say_so_and_leave_no_half_file(
    full_disk: Path, exported_model: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    model = copy_model(exported_model, full_disk / "model")
    (model / ONNX).unlink()  # exported again below, onto the full disk
    before = left_on(full_disk)
    fill(full_disk)

    exported = imageops("export", str(model), cwd=tmp_path)
    assert_named_disk_full(exported)
    assert left_on(full_disk) == before  # no model.onnx, whole or not

    scored = imageops(
        "score", str(exported_model), str(digits_split[1]), str(full_disk / "scores.csv"),
        cwd=tmp_path,
    )  # fmt: skip
    assert_named_disk_full(scored)
    assert left_on(full_disk) == before  # no table, no shard checkpoints


def test_version_onto_a_full_disk_says_so_and_leaves_no_staging_file_or_broken_pointer(
    digits_raw: Path, project
) -> None:
    """The push meets the full disk (the cache links the images, the remote copies them): DVC
    left a 0-byte staging file in the remote per image it could not copy (treeverse/dvc-objects
    #379) and said "files failed to upload". Once space is freed, the same command versions."""
    with tmpfs_at(project.project_root) as root:
        converted = imageops("convert", str(digits_raw), "data/images", cwd=root)
        assert converted.returncode == 0, converted.stderr
        fill(root, leave=64 << 10)  # room for DVC's records, not for a copy of the images

        done = imageops("version", "data/images", cwd=root)

        assert_named_disk_full(done)
        assert "failed to transfer" in done.stderr  # the push's copies failed, as intended
        assert [p for p in root.rglob("*.tmp")] == []
        for pointer in (p for p in root.rglob("*.dvc") if p.is_file()):
            assert yaml.safe_load(pointer.read_text())["outs"][0]["md5"]
        (root / "filler").unlink()
        again = imageops("version", "data/images", cwd=root)
        assert again.returncode == 0, again.stderr
        assert re.search(r"[0-9a-f]{32}\.dir", again.stdout)


def test_a_pointer_cut_short_by_a_full_disk_is_put_back(project) -> None:
    """DVC rewrites ``images.dvc`` in place: a full disk at that moment leaves it empty, a
    pointer to nothing. The one before is put back, and the error says the disk is full."""
    images = project.data_path / "images"
    images.mkdir(parents=True)
    (images / "a.txt").write_text("a")
    version(images, project)
    pointer = images.parent / "images.dvc"
    before = pointer.read_bytes()

    with (
        pytest.raises(DiskFullError),
        ensure_dvc_repo(project) as repo,
        nothing_half_done(repo, images, None),
    ):
        pointer.write_bytes(b"")
        raise OSError(errno.ENOSPC, "No space left on device", str(pointer))

    assert pointer.read_bytes() == before


def test_a_full_disk_is_not_retried_by_prefect() -> None:
    """The steps' retry policy: a full disk fails the task at once (it is still full seconds
    later), a crash is retried."""

    class State:
        def __init__(self, exc: BaseException) -> None:
            self.exc = exc

        def result(self) -> None:
            raise self.exc

    full = OSError(28, "No space left on device", "/data/out/model.onnx")
    assert isinstance(disk_full(full), DiskFullError)
    assert "/data/out/model.onnx" in disk_full(full).message
    assert _retry_unless_user_error(None, None, State(full)) is False
    torch_style = RuntimeError("PytorchStreamWriter failed writing file: No space left on device")
    assert _retry_unless_user_error(None, None, State(torch_style)) is False
    assert _retry_unless_user_error(None, None, State(RuntimeError("worker crashed"))) is True


def test_a_register_that_meets_a_full_disk_leaves_the_training_run_finished(
    tmp_path: Path, exported_model: Path, project
) -> None:
    """The artifact store fills up while `imageops register` logs the model into the training
    run: a named error, and the run keeps the FINISHED its training gave it; once space is
    freed, the same command registers the model and the run is still FINISHED."""
    import json

    from mlflow.tracking import MlflowClient

    from tasks.shared.tracking import configure_mlflow

    # the project's MLflow artifact store on the tmpfs
    with tmpfs_at(project.home_dir / "mlartifacts") as artifacts:
        experiment = configure_mlflow(project)
        client = MlflowClient(project.tracking_uri)
        run = client.create_run(experiment, run_name="a finished training")
        client.set_terminated(run.info.run_id, "FINISHED")
        model = copy_model(exported_model, tmp_path / "model")
        info = json.loads((model / "model.json").read_text())
        (model / "model.json").write_text(json.dumps({**info, "mlflow_run_id": run.info.run_id}))
        fill(artifacts)

        done = imageops("register", str(model), cwd=project.project_root)
        assert_named_disk_full(done)
        assert client.get_run(run.info.run_id).info.status == "FINISHED"

        (artifacts / "filler").unlink()
        again = imageops("register", str(model), cwd=project.project_root)
        assert again.returncode == 0, again.stderr
        assert client.get_run(run.info.run_id).info.status == "FINISHED"
