"""A folder output never destroys what stands at its destination unless imageops wrote it.

``atomic_directory`` (every step that writes a folder goes through it) replaces nothing, an empty
folder, or a folder of its own kind; a file, a symlink or a folder of other things is refused
before any work, and left exactly as it was (no ``.old`` copy hidden beside it). The hostile
corpus drives the same rule through the CLI for convert, split, transform and train.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from models.atomic import atomic_directory, atomic_file, check_destination, temp_name, write_bytes
from tasks.shared.errors import InvalidParameterError


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


@pytest.mark.parametrize("replaces", [None, "manifest.json"])
def test_a_file_or_a_link_as_destination_is_refused_and_kept(
    tmp_path: Path, replaces: str | None
) -> None:
    dest = tmp_path / "out"
    dest.write_text("mine")
    ran = []
    with (
        pytest.raises(InvalidParameterError, match="exists and is a file"),
        atomic_directory(dest, replaces=replaces),
    ):
        ran.append(True)
    assert ran == [] and dest.read_text() == "mine" and _siblings(dest) == ["out"]

    dest.unlink()
    (tmp_path / "folder").mkdir()
    dest.symlink_to(tmp_path / "folder")
    with (
        pytest.raises(InvalidParameterError, match="is a symlink"),
        atomic_directory(dest, replaces=replaces),
    ):
        ran.append(True)
    assert ran == [] and dest.is_symlink() and _siblings(dest) == ["folder", "out"]


def test_a_file_that_appears_while_the_work_runs_is_kept(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    with (
        pytest.raises(InvalidParameterError, match="exists and is a file"),
        atomic_directory(dest, replaces="manifest.json") as tmp,
    ):
        (tmp / "manifest.json").write_text("{}")
        dest.write_text("written meanwhile")
    assert dest.read_text() == "written meanwhile" and _siblings(dest) == ["out"]


def test_a_folder_is_replaced_only_when_empty_or_of_its_own_kind(tmp_path: Path) -> None:
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    with (
        pytest.raises(InvalidParameterError, match=r"no manifest\.json"),
        atomic_directory(dest, replaces="manifest.json"),
    ):
        pass
    assert os.listdir(dest) == ["notes.txt"] and _siblings(dest) == ["out"]

    (dest / "notes.txt").unlink()  # empty: replaced
    with atomic_directory(dest, replaces="manifest.json") as tmp:
        (tmp / "manifest.json").write_text("1")
    with atomic_directory(dest, replaces="manifest.json") as tmp:  # its own kind: replaced
        (tmp / "manifest.json").write_text("2")
    assert (dest / "manifest.json").read_text() == "2" and _siblings(dest) == ["out"]


def test_any_name_the_file_system_takes_is_written_atomically(tmp_path: Path) -> None:
    """A 255-byte name fits; ".<name>.<random>.tmp" would not: temporary names stay short."""
    longest = "n" * 251 + ".png"
    assert len(temp_name(longest)) < 64 and temp_name(longest).startswith(".nnn")
    write_bytes(tmp_path / longest, b"1")
    with atomic_file(tmp_path / "f" / longest) as tmp:
        tmp.write_bytes(b"2")
    dest = tmp_path / ("d" * 255)
    for text in ("3", "4"):  # the second replaces the first: through a ".<name>...old" sibling
        with atomic_directory(dest, replaces="manifest.json") as tmp:
            (tmp / "manifest.json").write_text(text)
    assert (tmp_path / longest).read_bytes() == b"1"
    assert (tmp_path / "f" / longest).read_bytes() == b"2"
    assert (dest / "manifest.json").read_text() == "4"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([longest, "f", dest.name])


def test_a_name_longer_than_the_file_system_takes_is_refused_with_the_limit(
    tmp_path: Path,
) -> None:
    too_long = "n" * 256
    limit = r"256 bytes long; this file system takes names of at most 255 bytes"
    with pytest.raises(InvalidParameterError, match=limit):
        write_bytes(tmp_path / too_long / "x.json", b"{}")
    with pytest.raises(InvalidParameterError, match=limit), atomic_file(tmp_path / too_long):
        pass
    with pytest.raises(InvalidParameterError, match=limit):
        check_destination(tmp_path / too_long / "images")
    assert list(tmp_path.iterdir()) == []
