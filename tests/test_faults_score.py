"""Scoring killed mid-way: the rerun scores only the missing shards and writes the same table."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import onnx
import pandas as pd
import pytest
from model_helpers import copy_model
from prefect_runs import task_runs_of

from models.directory import ONNX
from models.locks import lock_fd
from tasks.data.sample import write_digits
from tasks.inference.score import (
    CHECKPOINTS,
    PROBABILITY_PREFIX,
    ShardedScoring,
    checkpoint_dir,
    list_images,
    score,
    score_in_shards,
)
from tasks.shared import faults
from tasks.shared.settings import Settings

pytest_plugins = ["model_fixtures"]

SHARD_IMAGES, BATCH = 20, 2  # 80 images: 4 shards, each paying an ONNX Runtime start-up
OPTIONS = {"shard_images": SHARD_IMAGES, "batch_size": BATCH, "threads": 1}


def _finished(checkpoints: Path) -> list[Path]:
    """The complete shard tables (an atomic write's temporary file starts with a dot)."""
    return sorted(checkpoints.glob("*/[0-9]*.csv"))


def _swap_behind_the_key(image: Path, other: Path) -> bytes:
    """Make ``image`` decode as ``other`` with its size and mtime unchanged; its old bytes.

    The checkpoint key trusts each file's size and mtime (hashing every image would read the
    whole input once more), so a rerun still reuses the shard that holds ``image``; had the rerun
    scored that shard again, ``image``'s row would show ``other``'s scores.
    """
    original, stat = image.read_bytes(), image.stat()
    assert len(other.read_bytes()) <= len(original)
    # A PNG decoder stops at the IEND chunk: the padding that keeps the size is never read.
    image.write_bytes(other.read_bytes().ljust(len(original), b"\0"))
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    return original


def test_a_killed_scoring_resumes_from_its_finished_shards(
    exported_model: Path, project: Settings, tmp_path: Path
) -> None:
    images = write_digits(tmp_path / "photos", size=8, per_class=8)  # 80 real digits
    total = len(list_images(images)[0])
    count = total // SHARD_IMAGES
    out = tmp_path / "scores"
    out.mkdir()
    command = [
        sys.executable, "-m", "app.cli", "score", str(exported_model), str(images), "out.csv",
        "--shard-images", str(SHARD_IMAGES), "--batch-size", str(BATCH), "--threads", "1",
    ]  # fmt: skip

    # The first scoring SIGKILLs itself right after its second shard is written.
    killed = 2
    first = subprocess.run(
        command,
        cwd=out,
        env=os.environ | {faults.FAULT: f"score.shard_written:shard={killed - 1}:kill"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert first.returncode == -signal.SIGKILL, first.stderr
    # Killed mid-way: the shards before the kill written whole, no other, and no table that looks
    # finished.
    done = _finished(out / CHECKPOINTS)
    assert [p.name for p in done] == [f"{i:05d}.csv" for i in range(killed)]
    assert killed < count
    assert not (out / "out.csv").exists()

    # Shard 0 is finished: change one of its images without changing what the key sees.
    shard0 = [ref.file for ref in list_images(images)[0][:SHARD_IMAGES]]
    image, other = sorted(shard0, key=lambda p: -p.stat().st_size)[:2]
    original = _swap_behind_the_key(image, other)

    second = subprocess.run(command, cwd=out, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert f"Reusing {killed} of {count} finished shards" in second.stderr
    assert sorted(p.name for p in out.iterdir()) == ["out.csv"]  # the checkpoint is cleaned up

    image.write_bytes(original)  # the undisturbed run scores the images as they were
    reference = score_in_shards(
        exported_model, images, tmp_path / "reference" / "out.csv", **OPTIONS
    )
    # Byte for byte, so also the row of the swapped image: its shard was reused, not rescored.
    assert (out / "out.csv").read_bytes() == reference.read_bytes()
    table = pd.read_csv(reference).set_index("path").filter(like=PROBABILITY_PREFIX)
    assert len(table) == total
    swapped = [p.relative_to(images).as_posix() for p in (image, other)]
    assert (table.loc[swapped[0]] != table.loc[swapped[1]]).any()  # so a rescore would show


def _photos(digits_raw: Path, folder: Path) -> Path:
    """12 real scans in a flat folder: two shards of 6."""
    folder.mkdir()
    for path in sorted(digits_raw.rglob("*.png"))[:12]:
        shutil.copyfile(path, folder / path.name)
    return folder


def _plant(model: Path, images: Path, dest: Path) -> Path:
    """A finished first shard in ``dest``'s checkpoint, marked so its reuse shows in the table."""
    folder = checkpoint_dir(
        model, *list_images(images), dest, shard_images=6, batch_size=2, quantized=False
    )
    part = score(model, images, folder / "00000.csv", shard=(0, 2), batch_size=2, threads=1)
    table = pd.read_csv(part, dtype=str, keep_default_na=False)
    table.loc[0, "path"] = "planted.png"
    table.to_csv(part, index=False)
    return part


@pytest.mark.parametrize("change", ["nothing", "an image added", "the model file", "in use"])
def test_a_checkpoint_is_reused_only_by_the_same_scoring(
    exported_model: Path, digits_raw: Path, tmp_path: Path, change: str
) -> None:
    images = _photos(digits_raw, tmp_path / "photos")
    extra = sorted(digits_raw.rglob("*.png"))[12]
    model = (
        copy_model(exported_model, tmp_path / "model")
        if change == "the model file"
        else exported_model
    )
    dest = tmp_path / "out" / "scores.csv"
    planted = _plant(model, images, dest)
    planted_bytes = planted.read_bytes()

    held = None
    if change == "an image added":
        shutil.copyfile(extra, images / extra.name)
    elif change == "the model file":
        proto = onnx.load(model / ONNX)
        proto.doc_string = "exported again"
        onnx.save(proto, model / ONNX)
    elif change == "in use":  # another scoring of the same images holds the checkpoint
        held = os.open(planted.parent, os.O_RDONLY | os.O_DIRECTORY)
        assert lock_fd(held, wait=True)
    try:
        score_in_shards(model, images, dest, shard_images=6, batch_size=2, threads=1)
    finally:
        if held is not None:
            os.close(held)

    table = pd.read_csv(dest, dtype=str, keep_default_na=False)
    listing = [ref.path for ref in list_images(images)[0]]
    if change == "nothing":
        assert table["path"].tolist() == ["planted.png", *listing[1:]]  # the planted shard
        assert sorted(p.name for p in dest.parent.iterdir()) == ["scores.csv"]
    else:
        assert table["path"].tolist() == listing  # scored afresh
        # The other key's checkpoint (a changed input's, or a running scoring's) is left alone.
        assert planted.read_bytes() == planted_bytes
        assert sorted(p.name for p in dest.parent.iterdir()) == [CHECKPOINTS, "scores.csv"]
        assert [p.name for p in (dest.parent / CHECKPOINTS).iterdir()] == [planted.parent.name]


@pytest.mark.slow
def test_in_a_flow_only_the_missing_shards_become_tasks(
    prefect_api: None, exported_model: Path, digits_raw: Path, tmp_path: Path
) -> None:
    from prefect import flow

    from flows.score import score_in_flow

    images = _photos(digits_raw, tmp_path / "photos")
    dest = tmp_path / "out" / "scores.csv"
    _plant(exported_model, images, dest)

    @flow(name="score-resumed")
    def resumed() -> Path:
        return score_in_flow(
            ShardedScoring(exported_model, images, dest, shard_images=6, batch_size=2)
        )

    state = resumed(return_state=True)
    table = pd.read_csv(state.result(), dtype=str, keep_default_na=False)
    listing = [ref.path for ref in list_images(images)[0]]
    assert table["path"].tolist() == ["planted.png", *listing[1:]]  # the planted shard
    task_runs = task_runs_of(state.state_details.flow_run_id, want=1)
    assert [r.name.split("-")[0] for r in task_runs] == ["score"]  # shard 1 only
