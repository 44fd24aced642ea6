"""One working copy of the images: split and DVC link instead of copying, and edits stay local.

Measured on real file systems: the project's (ext4 here: no reflink, so hard links) and /dev/shm
(tmpfs, another file system: links fail there with EXDEV and the files are copied).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import PIL.Image
import pytest

from tasks.data.convert import convert
from tasks.data.file_links import Placer
from tasks.data.imagedir import read_manifest
from tasks.data.split import split
from tasks.data.versioning import version
from tasks.shared.errors import InvalidImageDirectoryError
from tasks.shared.settings import Settings
from tests.projects import dvc

_WRITE = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH


def _files(*roots: Path) -> Iterator[Path]:
    for root in roots:
        for folder, _dirs, names in os.walk(root):
            yield from (Path(folder) / name for name in names)


def _on_disk(roots: list[Path], images: set[str]) -> tuple[int, int]:
    """(bytes of image content, bytes of everything else) under ``roots``, each file counted
    once however many names it has (by device and inode). Image content is told by its sha256,
    so DVC's cache and remote objects (named by md5) count too."""
    seen: set[tuple[int, int]] = set()
    image_bytes = other_bytes = 0
    for path in _files(*roots):
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) in seen:
            continue
        seen.add((info.st_dev, info.st_ino))
        if hashlib.sha256(path.read_bytes()).hexdigest() in images:
            image_bytes += info.st_size
        else:
            other_bytes += info.st_size
    return image_bytes, other_bytes


def test_a_run_on_new_data_keeps_one_working_copy(project: Settings, digits_raw: Path) -> None:
    subprocess.run(["git", "init", "-q", str(project.project_root)], check=True)
    source = project.data_path / "raw" / "digits"  # where a user keeps the raw images
    shutil.copytree(digits_raw, source)
    data = project.data_path / "digits"
    manifest = convert(source, data / "images")
    split(data / "images", data / "train", data / "val", fraction=0.8, seed=1)
    for part in ("images", "train", "val"):
        version(data / part, project)

    images = {entry.sha256 for entry in manifest.images}
    source_bytes, _ = _on_disk([source], images)
    remote = Path(project.dvc_remote)
    assert remote.is_relative_to(project.project_root)  # the folder remote counts here
    with_remote, metadata = _on_disk([project.project_root], images)
    elsewhere = [p for p in project.project_root.iterdir() if p != project.home_dir]
    elsewhere += [p for p in project.home_dir.iterdir() if p != remote]
    without_remote, _ = _on_disk(elsewhere, images)
    print(
        f"source {source_bytes} B; on disk with the folder remote {with_remote} B "
        f"({with_remote / source_bytes:.2f}x), without it {without_remote} B "
        f"({without_remote / source_bytes:.2f}x); manifests and DVC files {metadata} B"
    )
    # Source, one working copy (images/ = train/ + val/ = DVC's cache), the remote's copy.
    assert with_remote <= 3.2 * source_bytes
    assert without_remote <= 2.2 * source_bytes  # the remote elsewhere (S3)

    # The working copy is one file per image, read-only (DVC's protection, and split's).
    cache = project.project_root / ".dvc" / "cache"
    cached = {(p.stat().st_dev, p.stat().st_ino) for p in _files(cache)}
    for part in ("train", "val"):
        for entry in read_manifest(data / part).images:
            linked, original = data / part / entry.path, data / "images" / entry.path
            assert os.path.samefile(linked, original)
            assert (linked.stat().st_dev, linked.stat().st_ino) in cached
            assert linked.stat().st_mode & _WRITE == 0
    # convert copies from the source: the user's raw images are never linked into imageops' data
    first = manifest.images[0]
    raw = source / (first.source_path or first.path)
    assert not os.path.samefile(raw, data / "images" / first.path)
    assert raw.stat().st_mode & _WRITE

    # A second run on changed data: unchanged images link to the cache's objects again.
    PIL.Image.new("RGB", (16, 16), (200, 10, 10)).save(source / "0" / "added.png")
    manifest = convert(source, data / "images")
    split(data / "images", data / "train", data / "val", fraction=0.8, seed=1)
    for part in ("images", "train", "val"):
        version(data / part, project)
    images |= {entry.sha256 for entry in manifest.images}
    source_bytes, _ = _on_disk([source], images)
    again, _ = _on_disk([project.project_root], images)
    assert again <= 3.2 * source_bytes, f"{again / source_bytes:.2f}x after a second run"

    # DVC sees nothing to do, and `dvc unprotect` gives one data set's file back as a copy.
    assert "up to date" in dvc("status", cwd=project.project_root).stdout
    edited = data / "train" / read_manifest(data / "train").images[0].path
    done = dvc("unprotect", str(edited), cwd=project.project_root)
    assert done.returncode == 0, done.stderr
    assert not os.path.samefile(edited, data / "images" / edited.relative_to(data / "train"))
    assert edited.stat().st_mode & stat.S_IWUSR


def test_split_copies_where_links_cannot_reach(tmp_path: Path, digits_split: tuple[Path, Path]):
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on a file system of its own")
    with tempfile.TemporaryDirectory(dir=shm) as elsewhere:
        source = Path(elsewhere) / "images"
        shutil.copytree(digits_split[0], source)
        split(source, tmp_path / "a", tmp_path / "b", fraction=0.5, seed=1)
        for entry in read_manifest(source).images:
            out = next(p for p in (tmp_path / "a", tmp_path / "b") if (p / entry.path).exists())
            copy = out / entry.path
            assert copy.stat().st_dev != (source / entry.path).stat().st_dev  # a real EXDEV
            assert hashlib.sha256(copy.read_bytes()).hexdigest() == entry.sha256
            assert copy.stat().st_mode & stat.S_IWUSR  # a copy is the user's to edit


def test_placer_falls_back_per_file(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on a file system of its own")
    here = tmp_path / "here.png"
    here.write_bytes(b"\x89PNG here")
    placer = Placer()
    with tempfile.TemporaryDirectory(dir=shm) as elsewhere:
        there = Path(elsewhere) / "there.png"
        there.write_bytes(b"\x89PNG there")
        assert placer.place(there, tmp_path / "from-there.png") == "copy"
        near = placer.place(here, tmp_path / "from-here.png")
    assert near in ("reflink", "hardlink")  # the other file system's failure did not stick
    assert (tmp_path / "from-here.png").read_bytes() == b"\x89PNG here"
    if near == "hardlink":
        assert os.path.samefile(here, tmp_path / "from-here.png")
        assert here.stat().st_mode & _WRITE == 0
    assert (tmp_path / "from-there.png").read_bytes() == b"\x89PNG there"
    assert placer.counts["copy"] == 1


def test_an_image_edited_through_a_link_is_refused_not_spread(
    tmp_path: Path, digits_split: tuple[Path, Path]
) -> None:
    images = tmp_path / "images"
    shutil.copytree(digits_split[0], images)
    split(images, tmp_path / "train", tmp_path / "val", fraction=0.5, seed=1)
    entry = read_manifest(tmp_path / "train").images[0]
    # Root writes past the read-only bits (the tests run as root); a user would have to chmod.
    with open(tmp_path / "train" / entry.path, "r+b") as image:
        image.write(b"edited")
    assert (images / entry.path).read_bytes().startswith(b"edited")  # one file, two names
    with pytest.raises(InvalidImageDirectoryError, match="sha256") as refused:
        split(images, tmp_path / "train2", tmp_path / "val2", fraction=0.5, seed=1)
    assert entry.path in str(refused.value) and "convert" in refused.value.hint
    assert not (tmp_path / "train2").exists() and not (tmp_path / "val2").exists()
