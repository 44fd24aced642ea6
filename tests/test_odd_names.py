"""Names as other tools make them: zip names with a false UTF-8 flag or in cp437, tar names
longer than the file system takes, label files naming what is not text.

A name that cannot be written or recorded as given is skipped with its reason; everything else is
still converted, and the manifest reads back (it never holds a name that is not text).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import zipfile
from pathlib import Path

import pytest
from hostile_inputs import rename_zip_members

from tasks.data.convert import convert, source_classes
from tasks.data.imagedir import Manifest, read_manifest
from tasks.data.split import split


def _zip(digits: Path, archive: Path, extra: dict[str, bytes]) -> Path:
    """Two digit classes (two scans each) under ``d/``, plus ``extra`` (name -> bytes)."""
    with zipfile.ZipFile(archive, "w") as zf:
        for label in ("0", "1"):
            for png in sorted((digits / label).glob("*.png"))[:2]:
                zf.write(png, f"d/{label}/{png.name}")
        for name, data in extra.items():
            zf.writestr(name, data)
    return archive


def _png(digits: Path) -> bytes:
    return next((digits / "2").glob("*.png")).read_bytes()


def _reasons(manifest: Manifest) -> dict[str, str]:
    return {s.path: s.reason for s in manifest.skipped}


def test_a_name_falsely_flagged_utf8_is_skipped_and_the_rest_converted(
    digits_raw: Path, tmp_path: Path
) -> None:
    archive = _zip(digits_raw, tmp_path / "a.zip", {"d/0/cafX.png": _png(digits_raw)})
    rename_zip_members(archive, {b"d/0/cafX.png": b"d/0/caf\xe9.png"}, utf8=True)
    with pytest.raises(UnicodeDecodeError):  # what zipfile alone makes of it
        zipfile.ZipFile(archive)

    manifest = convert(archive, tmp_path / "out")

    assert sorted(e.path for e in manifest.images) == sorted(
        f"{label}/{png.name}"
        for label in ("0", "1")
        for png in sorted((digits_raw / label).glob("*.png"))[:2]
    )
    reason = _reasons(manifest)["d/0/caf\\xe9.png"]
    assert reason.startswith("BadFileName: the zip says this name is UTF-8, but it is not")
    assert read_manifest(tmp_path / "out") == manifest.whole()
    assert source_classes(archive) == ["0", "1"]


def test_names_without_the_utf8_flag_are_decoded_as_their_writer_meant(
    digits_raw: Path, tmp_path: Path
) -> None:
    png = _png(digits_raw)
    extra = {"d/0/cafX.png": png, "d/1/naXXve.png": png, "d/1/数字.png": png}
    archive = _zip(digits_raw, tmp_path / "a.zip", extra)
    names = {
        b"d/0/cafX.png": b"d/0/caf\x82.png",  # cp437, the zip format's own encoding
        b"d/1/naXXve.png": "d/1/naïve.png".encode(),  # UTF-8, the flag left unset
    }
    rename_zip_members(archive, names, utf8=False)

    manifest = convert(archive, tmp_path / "out")

    paths = {e.path for e in manifest.images}
    assert {"0/café.png", "1/naïve.png", "1/数字.png"} <= paths  # the last one flagged UTF-8
    assert manifest.skipped == []
    assert (tmp_path / "out" / "1" / "naïve.png").read_bytes() == png


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT], ids=["gnu", "pax"])
def test_tar_names_longer_than_the_file_system_takes_are_skipped(
    digits_raw: Path, tmp_path: Path, fmt: int
) -> None:
    png = _png(digits_raw)
    longest = "x" * 251 + ".png"  # 255 bytes: the most a name may have
    too_long = "y" * 252 + ".png"
    deep = "/".join(["d" * 200] * 3) + "/deep.png"  # a 600-byte path of names that fit
    archive = tmp_path / "a.tar"
    with tarfile.open(archive, "w", format=fmt) as tar:
        for name in ("0/a.png", f"0/{longest}", f"0/{too_long}", f"1/{deep}", "1/b.png"):
            info = tarfile.TarInfo(name)
            info.size = len(png)
            tar.addfile(info, io.BytesIO(png))

    manifest = convert(archive, tmp_path / "out")

    assert sorted(e.path for e in manifest.images) == sorted(
        ["0/a.png", f"0/{longest}", f"1/{deep}", "1/b.png"]
    )
    assert _reasons(manifest) == {
        f"0/{too_long}": "BadFileName: a name longer than the 255 bytes this file system takes"
    }


def test_a_refused_tar_member_that_is_not_utf8_is_reported_readably(
    digits_raw: Path, tmp_path: Path
) -> None:
    png = _png(digits_raw)
    archive = tmp_path / "a.tar"
    with tarfile.open(archive, "w") as tar:
        for name in ("0/a.png", "1/b.png", os.fsdecode(b"1/f\xe9.png")):
            info = tarfile.TarInfo(name)
            info.size = len(png)
            tar.addfile(info, io.BytesIO(png))
        link = tarfile.TarInfo(os.fsdecode(b"0/l\xe9nk.png"))
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)

    manifest = convert(archive, tmp_path / "out")

    assert sorted(e.path for e in manifest.images) == ["0/a.png", "1/b.png"]
    reasons = {path: reason.split(":")[0] for path, reason in _reasons(manifest).items()}
    assert reasons == {"0/l\\xe9nk.png": "UnsafeArchiveMember", "1/f\\xe9.png": "BadFileName"}
    assert read_manifest(tmp_path / "out") == manifest.whole()  # no lone surrogate in the JSON


def test_coco_names_that_are_not_text_are_skipped(digits_raw: Path, tmp_path: Path) -> None:
    """JSON may spell a lone surrogate ("\\udce9"); Python would even open the Latin-1 file it
    stands for, but no manifest could record its name."""
    photos = tmp_path / "photos"
    photos.mkdir()
    for name in ("a.png", "b.png", "c.png"):
        shutil.copy(next((digits_raw / "0").glob("*.png")), photos / name)
    shutil.copy(photos / "a.png", os.fsdecode(os.fsencode(photos) + b"/caf\xe9.png"))
    files = ["a.png", "b.png", "c.png", "caf\udce9.png"]
    labels = json.dumps(
        {
            "images": [{"id": i, "file_name": f"photos/{f}"} for i, f in enumerate(files)],
            "categories": [{"id": 0, "name": "zero"}, {"id": 1, "name": "one"},
                           {"id": 2, "name": "bad\udce9"}],
            "annotations": [{"id": i, "image_id": i, "category_id": c}
                            for i, c in enumerate([0, 1, 2, 0])],
        }
    )  # fmt: skip
    (tmp_path / "labels.json").write_text(labels)  # json.dumps writes the surrogate escaped

    manifest = convert(tmp_path / "labels.json", tmp_path / "out")

    assert manifest.classes == ["one", "zero"]
    assert sorted(e.source_path for e in manifest.images) == ["photos/a.png", "photos/b.png"]
    reasons = {path: reason.split(":")[0] for path, reason in _reasons(manifest).items()}
    assert reasons == {"photos/c.png": "BadLabel", "photos/caf\\xe9.png": "BadFileName"}
    assert read_manifest(tmp_path / "out") == manifest.whole()


def test_a_class_folder_named_like_a_drive_is_skipped_so_split_reads_the_result(
    digits_raw: Path, tmp_path: Path
) -> None:
    """A class folder `C:` once became manifest paths `C:/x.png`, which split refuses."""
    source = tmp_path / "src"
    for label in ("0", "1", "C:"):
        (source / label).mkdir(parents=True)
        for png in sorted((digits_raw / ("2" if label == "C:" else label)).glob("*.png"))[:3]:
            shutil.copy(png, source / label / png.name)

    manifest = convert(source, tmp_path / "out")

    assert manifest.classes == ["0", "1"]
    reasons = _reasons(manifest)
    drive = [path for path in reasons if path.startswith("C:/") and path != "C:/"]
    assert len(drive) == 3
    assert all(reasons[path].startswith("BadFileName: stored as 'C:/") for path in drive)
    first, second = split(tmp_path / "out", tmp_path / "a", tmp_path / "b", fraction=0.5)
    assert len(first.images) + len(second.images) == 6
