"""Convert to Image Directory on real digit scans: folders, archives, bad files, hostile input."""

from __future__ import annotations

import hashlib
import io
import os
import random
import shutil
import struct
import subprocess
import sys
import tarfile
import zipfile
import zlib
from pathlib import Path

import pytest
from PIL import Image

from tasks.data import imagecheck
from tasks.data.convert import ConvertLimits, convert
from tasks.data.imagedir import MANIFEST, ImageRefused, Manifest, load_rgb, read_manifest
from tasks.shared.errors import InvalidParameterError, NoUsableImagesError, UnsafeArchiveError


def _copy_classes(src: Path, dst: Path, per_class: int) -> Path:
    """The first ``per_class`` images of each class of ``src`` (digits_raw must not change)."""
    for folder in sorted(p for p in src.iterdir() if p.is_dir()):
        (dst / folder.name).mkdir(parents=True)
        for path in sorted(folder.glob("*.png"))[:per_class]:
            shutil.copyfile(path, dst / folder.name / path.name)
    return dst


def _codes(manifest: Manifest) -> dict[str, str]:
    """Skipped path -> reason code (the reason's first word)."""
    return {s.path: s.reason.split(":", 1)[0] for s in manifest.skipped}


def _png_header(width: int, height: int) -> bytes:
    """A PNG claiming ``width`` x ``height`` pixels in a few dozen bytes: a decompression bomb."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


def _files_below(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


# --- folders ----------------------------------------------------------------------------------


def test_labeled_folder_becomes_an_image_directory(digits_raw: Path, tmp_path: Path) -> None:
    dest = tmp_path / "images"

    manifest = convert(digits_raw, dest)

    assert manifest.labeled
    assert manifest.classes == ["0", "1", "2"]
    assert manifest.counts == {"0": 30, "1": 30, "2": 30}
    assert manifest.skipped == [] and manifest.duplicates == []
    assert manifest.source == str(digits_raw.resolve())
    assert read_manifest(dest) == manifest.whole()
    assert _files_below(dest) == {e.path for e in manifest.images} | {MANIFEST}
    for entry in manifest.images:
        data = (dest / entry.path).read_bytes()
        assert data == (digits_raw / entry.path).read_bytes()  # copied byte for byte
        assert hashlib.sha256(data).hexdigest() == entry.sha256
        assert (entry.width, entry.height) == (16, 16)
        assert manifest.classes[entry.label] == entry.path.split("/")[0]
    # No temporary folder is left beside the result.
    assert [p.name for p in tmp_path.iterdir()] == ["images"]


def test_process_pool_gives_the_same_manifest(digits_raw: Path, tmp_path: Path) -> None:
    # 90 files: over the pool threshold, so workers=2 spawns a process and checks the two
    # halves (stripes) side by side, each written to its part of the list; three stripes too.
    pooled = convert(digits_raw, tmp_path / "pooled", workers=2)
    in_process = convert(digits_raw, tmp_path / "in_process", workers=1)
    three = convert(digits_raw, tmp_path / "three", workers=3)

    assert pooled.model_dump(exclude={"source"}) == in_process.model_dump(exclude={"source"})
    assert three.model_dump(exclude={"source"}) == in_process.model_dump(exclude={"source"})
    assert pooled.images == three.images == in_process.images and in_process.image_count == 90
    assert [e.path for e in in_process.images] == sorted(e.path for e in in_process.images)
    assert _files_below(tmp_path / "pooled") == _files_below(tmp_path / "in_process")


class _Terminal(io.StringIO):
    """Standard error as a person's terminal: the progress bar only draws on one."""

    def isatty(self) -> bool:
        return True


def test_a_terminal_sees_a_progress_bar_that_reaches_every_image(
    digits_raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)

    manifest = convert(digits_raw, tmp_path / "out", workers=2)

    drawn = terminal.getvalue()
    assert "Checking images" in drawn
    assert f"{len(manifest.images)}/{len(manifest.images)}" in drawn


def test_flat_folder_is_unlabeled(digits_raw: Path, tmp_path: Path) -> None:
    flat = tmp_path / "flat"
    flat.mkdir()
    for path in sorted(digits_raw.rglob("*.png"))[::15]:
        shutil.copyfile(path, flat / path.name)

    manifest = convert(flat, tmp_path / "out")

    assert not manifest.labeled
    assert manifest.classes == [] and manifest.counts == {}
    assert len(manifest.images) == 6
    assert all(e.label is None and "/" not in e.path for e in manifest.images)
    assert read_manifest(tmp_path / "out").labeled is False


def test_bad_files_are_skipped_with_their_reason(digits_raw: Path, tmp_path: Path) -> None:
    src = _copy_classes(digits_raw, tmp_path / "src", per_class=3)
    good = (src / "0" / sorted(p.name for p in (src / "0").iterdir())[0]).read_bytes()
    with Image.open(io.BytesIO(good)) as img:
        jpeg = io.BytesIO()
        img.resize((64, 64)).save(jpeg, "JPEG", quality=90)
    bad = src / "1"
    (bad / "zero.png").write_bytes(b"")
    (bad / "corrupt.png").write_bytes(good[:60] + bytes([good[60] ^ 0xFF]) + good[61:])
    (bad / "truncated.png").write_bytes(good[: len(good) // 2])
    (bad / "truncated.jpg").write_bytes(jpeg.getvalue()[: len(jpeg.getvalue()) * 2 // 3])
    (bad / "text.png").write_text("not an image at all")
    (bad / "misnamed.jpg").write_bytes(good)  # a PNG named .jpg
    (bad / "notes.txt").write_text("scanned on a Tuesday")
    (bad / "nested.zip").write_bytes(b"PK\x05\x06" + b"\x00" * 18)
    (src / "README.md").write_text("digits")  # beside the class folders: not an image
    (src / "0" / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")

    manifest = convert(src, tmp_path / "out")

    assert _codes(manifest) == {
        "0/.DS_Store": "HiddenFile",
        "1/corrupt.png": "UnreadableImage",
        "1/misnamed.jpg": "ExtensionMismatch",
        "1/nested.zip": "NotAnImage",
        "1/notes.txt": "NotAnImage",
        "1/text.png": "NotAnImage",
        "1/truncated.jpg": "UnreadableImage",
        "1/truncated.png": "UnreadableImage",
        "1/zero.png": "EmptyFile",
        "README.md": "NotInClassFolder",
    }
    nested = next(s for s in manifest.skipped if s.path == "1/nested.zip")
    assert "not unpacked" in nested.reason
    assert manifest.counts == {"0": 3, "1": 3, "2": 3}
    assert _files_below(tmp_path / "out") == {e.path for e in manifest.images} | {MANIFEST}


def test_class_folder_without_a_valid_image_is_reported(digits_raw: Path, tmp_path: Path) -> None:
    src = _copy_classes(digits_raw, tmp_path / "src", per_class=2)
    (src / "7").mkdir()
    (src / "7" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (src / "8").mkdir()  # empty

    manifest = convert(src, tmp_path / "out")

    assert manifest.classes == ["0", "1", "2"]  # ids stay dense: no class without images
    assert _codes(manifest) == {
        "7/": "EmptyClass",
        "7/broken.png": "UnreadableImage",
        "8/": "EmptyClass",
    }


def test_duplicates_are_kept_and_listed(digits_raw: Path, tmp_path: Path) -> None:
    src = _copy_classes(digits_raw, tmp_path / "src", per_class=2)
    original = sorted((src / "0").iterdir())[0]
    shutil.copyfile(original, src / "0" / "copy.png")
    shutil.copyfile(original, src / "1" / "same_as_a_zero.png")

    manifest = convert(src, tmp_path / "out")

    assert len(manifest.images) == 8  # kept
    assert manifest.duplicates == [
        sorted([f"0/{original.name}", "0/copy.png", "1/same_as_a_zero.png"])
    ]
    assert read_manifest(tmp_path / "out").duplicates == manifest.duplicates


def test_images_over_the_pixel_limit_are_refused_from_the_header(
    digits_raw: Path, tmp_path: Path
) -> None:
    src = _copy_classes(digits_raw, tmp_path / "src", per_class=2)
    (src / "0" / "bomb.png").write_bytes(_png_header(100_000, 100_000))  # over Pillow's own cap
    (src / "0" / "big.png").write_bytes(_png_header(8_000, 8_000))  # 64 M: over ours only
    global_limit = Image.MAX_IMAGE_PIXELS

    manifest = convert(src, tmp_path / "out")
    at_the_limit = convert(src, tmp_path / "at_the_limit", ConvertLimits(max_pixels=16 * 16))

    assert _codes(manifest) == {"0/big.png": "ImageExceedsLimit", "0/bomb.png": "ImageExceedsLimit"}
    big = next(s for s in manifest.skipped if s.path == "0/big.png")
    assert "64,000,000 pixels is over the limit of 40,000,000" in big.reason
    assert len(manifest.images) == len(at_the_limit.images) == 6
    with pytest.raises(NoUsableImagesError, match="8 ImageExceedsLimit"):
        convert(src, tmp_path / "none", ConvertLimits(max_pixels=16 * 16 - 1))
    assert global_limit == Image.MAX_IMAGE_PIXELS  # Pillow's global state is untouched


def _strip(width: int, height: int) -> bytes:
    """An 8-bit gray PNG of ``width`` x ``height``."""
    buffer = io.BytesIO()
    Image.new("L", (width, height), 128).save(buffer, "PNG")
    return buffer.getvalue()


def test_convert_and_every_reader_refuse_the_same_slivers(digits_raw: Path, tmp_path: Path) -> None:
    src = _copy_classes(digits_raw, tmp_path / "src", per_class=1)
    (src / "0" / "edge.png").write_bytes(_strip(1, 100))  # 100:1, the limit itself
    (src / "0" / "sliver.png").write_bytes(_strip(101, 1))

    manifest = convert(src, tmp_path / "out")
    wide = convert(src, tmp_path / "wide", ConvertLimits(max_aspect_ratio=101))

    assert _codes(manifest) == {"0/sliver.png": "ImageExceedsLimit"}
    (reason,) = [s.reason for s in manifest.skipped]
    assert "101x1 has an aspect ratio of 101:1, over the limit of 100:1" in reason
    assert "0/edge.png" in {e.path for e in manifest.images}
    assert _codes(wide) == {}
    # Score, train, transform, export and quantize read through load_rgb: the same limit, the
    # same words, found before decoding.
    with pytest.raises(ImageRefused) as refused:
        load_rgb(src / "0" / "sliver.png")
    assert refused.value.reason == reason
    assert load_rgb(src / "0" / "edge.png").size == (1, 100)


def test_the_environment_raises_the_image_limits_for_every_step_alike(
    digits_raw: Path, tmp_path: Path
) -> None:
    """IMAGEOPS_MAX_ASPECT_RATIO: convert keeps the sliver, and score reads it as an image."""
    src = _copy_classes(digits_raw, tmp_path / "src", per_class=1)
    (src / "0" / "sliver.png").write_bytes(_strip(150, 1))
    probe = (
        "import sys; from pathlib import Path; from tasks.data.convert import convert; "
        "from tasks.data.imagedir import load_rgb; "
        "m = convert(Path(sys.argv[1]), Path(sys.argv[2]), workers=1); "
        "print(sorted(s.path for s in m.skipped), load_rgb(Path(sys.argv[1], '0/sliver.png')).size)"
    )

    def run(dest: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", probe, str(src), str(tmp_path / dest)],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
        )

    default = run("default")
    raised = run("raised", IMAGEOPS_MAX_ASPECT_RATIO="150")
    wrong = run("wrong", IMAGEOPS_MAX_ASPECT_RATIO="wide")

    assert default.returncode != 0 and "over the limit of 100:1" in default.stderr
    assert "set IMAGEOPS_MAX_ASPECT_RATIO higher" in default.stderr
    assert raised.returncode == 0, raised.stderr
    assert raised.stdout.split() == ["[]", "(150,", "1)"]  # kept by convert, read by the rest
    assert "IMAGEOPS_MAX_ASPECT_RATIO = 'wide', expected a whole number" in wrong.stderr


def test_the_archive_caps_are_options_of_the_convert_command(
    digits_raw: Path, tmp_path: Path
) -> None:
    src = tmp_path / "bomb.zip"
    with zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED) as zf:
        for label in ("0", "1"):
            for image in sorted((digits_raw / label).iterdir())[:3]:
                zf.write(image, f"{label}/{image.name}")
        zf.writestr("1/zeros.png", bytes(24 * 1024**2))  # 24 MiB of zeros: about 1000:1

    def convert_cli(dest: str, *options: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "app.cli", "convert", str(src), str(tmp_path / dest)]
        return subprocess.run([*command, *options], capture_output=True, text=True)

    capped = convert_cli("capped")
    allowed = convert_cli("allowed", "--max-archive-ratio", "5000")

    assert capped.returncode == 2, capped.stderr
    assert "error: UnsafeArchiveError:" in capped.stderr
    assert "again with a larger --max-archive-ratio" in capped.stderr  # the option to change
    assert not (tmp_path / "capped").exists()
    assert allowed.returncode == 0, allowed.stderr
    assert "skipped 1/zeros.png: NotAnImage" in allowed.stdout  # extracted, then judged


def test_files_are_judged_by_extension_and_size_before_reading(
    digits_raw: Path, tmp_path: Path
) -> None:
    src = _copy_classes(digits_raw, tmp_path / "src", per_class=2)
    for name in ("0/clip.mov", "1/huge.png"):  # 3 GiB each, sparse: no disk, no time
        with open(src / name, "wb") as fh:
            fh.truncate(3 * 1024**3)
    dest = tmp_path / "out"

    manifest = convert(src, dest, workers=1)
    inode = dest.stat().st_ino
    again = convert(src, dest, workers=1)  # the cache check does not read them either

    assert _codes(manifest) == {"0/clip.mov": "NotAnImage", "1/huge.png": "ImageExceedsLimit"}
    huge = next(s.reason for s in manifest.skipped if s.path == "1/huge.png")
    assert "the file is 3,221,225,472 bytes" in huge and "336,777,216" in huge
    assert again == manifest and dest.stat().st_ino == inode  # a cache hit: nothing rewritten


def test_big_files_are_streamed_and_checked_from_their_copy(
    digits_raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _copy_classes(digits_raw, tmp_path / "src", per_class=2)
    good = next((src / "0").glob("*.png")).read_bytes()
    (src / "1" / "truncated.png").write_bytes(good[: len(good) // 2])
    (src / "1" / "sliver.png").write_bytes(_strip(1, 1000))
    in_memory = convert(src, tmp_path / "in-memory", workers=1)

    monkeypatch.setattr(imagecheck, "IN_MEMORY_BYTES", 64)  # every file here is "big" now
    streamed = convert(src, tmp_path / "streamed", workers=1)

    assert streamed == in_memory  # same entries, hashes, sizes, reasons and fingerprint
    assert _codes(streamed) == {
        "1/sliver.png": "ImageExceedsLimit",
        "1/truncated.png": "UnreadableImage",
    }
    for entry in streamed.images:
        data = (tmp_path / "streamed" / entry.path).read_bytes()
        assert data == (src / entry.path).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry.sha256 and len(data) == entry.size
    assert _files_below(tmp_path / "streamed") == {e.path for e in streamed.images} | {MANIFEST}


def test_no_usable_image_raises_and_writes_nothing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "notes.txt").write_text("no images here")
    (src / "a" / "empty.png").write_bytes(b"")

    with pytest.raises(NoUsableImagesError, match="everything was skipped") as err:
        convert(src, tmp_path / "out")

    assert "EmptyFile" in str(err.value) and "NotAnImage" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no dest, no temp folder


def test_a_failed_convert_keeps_the_previous_directory(digits_raw: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    before = convert(_copy_classes(digits_raw, tmp_path / "good", per_class=1), dest)
    empty = tmp_path / "empty"
    empty.mkdir()

    with pytest.raises(NoUsableImagesError, match="holds no files"):
        convert(empty, dest)

    assert read_manifest(dest) == before.whole()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "good", "out"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_pixels": 0}, "max_pixels must be a whole number >= 1"),
        ({"workers": 0}, "workers must be >= 1"),
        ({"max_archive_members": -1}, "max_archive_members"),
        ({"max_aspect_ratio": 0}, "max_aspect_ratio must be a whole number >= 1"),
        ({"max_archive_ratio": 0.5}, "max_archive_ratio"),
        ({"max_archive_member_bytes": 0}, "max_archive_member_bytes"),
    ],
)
def test_parameters_out_of_range_are_refused(
    digits_raw: Path, tmp_path: Path, kwargs: dict, message: str
) -> None:
    kwargs = dict(kwargs)
    workers = kwargs.pop("workers", None)
    with pytest.raises(InvalidParameterError, match=message):
        convert(digits_raw, tmp_path / "out", ConvertLimits(**kwargs), workers=workers)
    assert not (tmp_path / "out").exists()


def test_dest_overlapping_source_is_refused(digits_raw: Path, tmp_path: Path) -> None:
    src = _copy_classes(digits_raw, tmp_path / "src", per_class=1)
    before = _files_below(src)

    for dest in (src, src / "images", tmp_path):
        with pytest.raises(InvalidParameterError, match="overlap"):
            convert(src, dest)
    assert _files_below(src) == before


def test_missing_source_and_unknown_file_type_are_refused(tmp_path: Path) -> None:
    with pytest.raises(NoUsableImagesError, match="does not exist"):
        convert(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "photos.rar").write_bytes(b"Rar!")
    with pytest.raises(NoUsableImagesError, match="neither a folder nor an archive"):
        convert(tmp_path / "photos.rar", tmp_path / "out")


# --- archives ---------------------------------------------------------------------------------


def test_zip_with_a_wrapping_folder_is_unwrapped(digits_raw: Path, tmp_path: Path) -> None:
    src = _copy_classes(digits_raw, tmp_path / "src", per_class=3)
    archive = tmp_path / "digits.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(src.rglob("*.png")):
            zf.write(path, f"digits/{path.relative_to(src).as_posix()}")
        zf.writestr("__MACOSX/digits/0/._x.png", b"\x00\x05\x16\x07")

    manifest = convert(archive, tmp_path / "out")
    from_folder = convert(src, tmp_path / "from_folder")

    assert manifest.classes == ["0", "1", "2"]
    assert manifest.images == from_folder.images  # same paths, labels and hashes
    assert manifest.source == str(archive.resolve())
    assert _codes(manifest) == {"__MACOSX": "HiddenFile"}
    assert not [p for p in tmp_path.iterdir() if "extract" in p.name]  # temp folder removed


def test_zip_of_a_flat_folder_is_unlabeled(digits_raw: Path, tmp_path: Path) -> None:
    archive = tmp_path / "photos.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in sorted(digits_raw.rglob("*.png"))[:4]:
            zf.write(path, f"photos/{path.name}")

    manifest = convert(archive, tmp_path / "out")

    assert not manifest.labeled and len(manifest.images) == 4


@pytest.mark.parametrize(
    ("suffix", "mode"),
    [(".tar", "w"), (".tar.gz", "w:gz"), (".tgz", "w:gz"), (".tar.bz2", "w:bz2")],
)
def test_tar_archives(digits_raw: Path, tmp_path: Path, suffix: str, mode: str) -> None:
    src = _copy_classes(digits_raw, tmp_path / "src", per_class=2)
    archive = tmp_path / f"digits{suffix}"
    with tarfile.open(archive, mode) as tf:
        tf.add(src, arcname=".")  # `tar -C src -cf digits.tar .`: members start with ./

    manifest = convert(archive, tmp_path / "out")

    assert manifest.counts == {"0": 2, "1": 2, "2": 2}
    assert manifest.skipped == []
    assert manifest.images == convert(src, tmp_path / "from_folder").images


def test_zip_slip_members_are_refused_and_nothing_lands_outside(
    digits_raw: Path, tmp_path: Path
) -> None:
    image = sorted(digits_raw.rglob("*.png"))[0].read_bytes()
    work = tmp_path / "deep" / "work"
    work.mkdir(parents=True)
    archive = work / "evil.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("0/good.png", image)
        zf.writestr("1/good.png", image)
        zf.writestr("../../escaped.png", image)
        zf.writestr("0/../../../escaped2.png", image)
        zf.writestr("/tmp/absolute.png", image)
        zf.writestr("..\\..\\windows.png", image)
        link = zipfile.ZipInfo("0/link.png")
        link.external_attr = (0o120777 << 16) | 0  # a symlink, as `zip --symlinks` writes it
        zf.writestr(link, "/etc/passwd")
        with pytest.warns(UserWarning, match="Duplicate name"):
            zf.writestr("0/good.png", image)  # the same name again

    manifest = convert(archive, work / "out")

    assert _codes(manifest) == {
        "../../escaped.png": "UnsafeArchiveMember",
        "0/../../../escaped2.png": "UnsafeArchiveMember",
        "/tmp/absolute.png": "UnsafeArchiveMember",
        "..\\..\\windows.png": "UnsafeArchiveMember",
        "0/link.png": "UnsafeArchiveMember",
        "0/good.png": "UnsafeArchiveMember",  # the duplicate; the first one was kept
    }
    assert [e.path for e in manifest.images] == ["0/good.png", "1/good.png"]
    written = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert written == {
        "deep/work/evil.zip",
        "deep/work/out/0/good.png",
        "deep/work/out/1/good.png",
        "deep/work/out/manifest.json",
    }
    assert not Path("/tmp/absolute.png").exists()


def test_tar_links_and_devices_are_refused_and_nothing_lands_outside(
    digits_raw: Path, tmp_path: Path
) -> None:
    image = sorted(digits_raw.rglob("*.png"))[0].read_bytes()
    outside = tmp_path / "outside"
    outside.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    archive = work / "evil.tar.gz"

    def member(name: str, kind: bytes = tarfile.REGTYPE, **attrs: object) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type = kind
        for key, value in attrs.items():
            setattr(info, key, value)
        return info

    with tarfile.open(archive, "w:gz") as tf:
        for name in ("0/good.png", "1/good.png"):
            tf.addfile(member(name, size=len(image)), io.BytesIO(image))
        # The classic: a link to a folder outside, then a file written "through" it.
        tf.addfile(member("0/escape", tarfile.SYMTYPE, linkname=str(outside)))
        through = member("0/escape/pwned.png", size=len(image))
        tf.addfile(through, io.BytesIO(image))
        tf.addfile(member("0/passwd.png", tarfile.LNKTYPE, linkname="/etc/passwd"))
        tf.addfile(member("0/null.png", tarfile.CHRTYPE, devmajor=1, devminor=3))
        tf.addfile(member("0/pipe.png", tarfile.FIFOTYPE))
        up = member("../../up.png", size=len(image))
        tf.addfile(up, io.BytesIO(image))

    manifest = convert(archive, work / "out")

    assert _codes(manifest) == {
        "0/escape": "UnsafeArchiveMember",
        "0/passwd.png": "UnsafeArchiveMember",
        "0/null.png": "UnsafeArchiveMember",
        "0/pipe.png": "UnsafeArchiveMember",
        "../../up.png": "UnsafeArchiveMember",
    }
    reasons = {s.path: s.reason for s in manifest.skipped}
    assert "symlink" in reasons["0/escape"] and "hard link" in reasons["0/passwd.png"]
    # The file "through" the refused link landed, harmlessly, in a real folder inside dest.
    assert [e.path for e in manifest.images] == ["0/escape/pwned.png", "0/good.png", "1/good.png"]
    assert list(outside.iterdir()) == []
    assert not (tmp_path / "up.png").exists() and not (work / "up.png").exists()
    assert not any(p.is_symlink() for p in (work / "out").rglob("*"))


def test_archive_over_the_caps_is_refused_whole(digits_raw: Path, tmp_path: Path) -> None:
    src = _copy_classes(digits_raw, tmp_path / "src", per_class=2)
    archive = tmp_path / "digits.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in sorted(src.rglob("*.png")):
            zf.write(path, path.relative_to(src).as_posix())
    tar = tmp_path / "digits.tar"
    with tarfile.open(tar, "w") as tf:
        tf.add(src, arcname=".")

    with pytest.raises(UnsafeArchiveError, match="more than 5 members"):
        convert(archive, tmp_path / "out", ConvertLimits(max_archive_members=5))
    with pytest.raises(UnsafeArchiveError, match="more than 5 members"):
        convert(tar, tmp_path / "out", ConvertLimits(max_archive_members=5))
    with pytest.raises(UnsafeArchiveError, match="unpacks to more than 1,000 bytes"):
        convert(archive, tmp_path / "out", ConvertLimits(max_archive_bytes=1_000))
    with pytest.raises(UnsafeArchiveError, match="unpacks to more than 1,000 bytes"):
        convert(tar, tmp_path / "out", ConvertLimits(max_archive_bytes=1_000))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits.tar", "digits.zip", "src"]


def test_archive_members_over_the_member_caps_are_skipped(digits_raw: Path, tmp_path: Path) -> None:
    src = _copy_classes(digits_raw, tmp_path / "src", per_class=2)
    noise = random.Random(1).randbytes(300_000)  # incompressible: keeps the archive's ratio low
    archive = tmp_path / "digits.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(src.rglob("*.png")):
            zf.write(path, path.relative_to(src).as_posix())
        zf.writestr("0/zeros.png", bytes(20 * 1024**2))  # 20 MiB -> 20 KB: 1,000:1
        zf.writestr("1/noise.bin", noise)
    tar = tmp_path / "digits.tar"
    with tarfile.open(tar, "w") as tf:
        tf.add(src, arcname=".")
        info = tarfile.TarInfo("1/noise.bin")
        info.size = len(noise)
        tf.addfile(info, io.BytesIO(noise))

    zipped = convert(archive, tmp_path / "zip")
    capped = convert(
        archive, tmp_path / "zip-capped", ConvertLimits(max_archive_member_bytes=100_000)
    )
    tarred = convert(tar, tmp_path / "tar", ConvertLimits(max_archive_member_bytes=100_000))

    assert _codes(zipped) == {"0/zeros.png": "UnsafeArchiveMember", "1/noise.bin": "NotAnImage"}
    zeros = next(s.reason for s in zipped.skipped if s.path == "0/zeros.png")
    assert "more than 200 times its" in zeros and "--max-archive-ratio" in zeros
    assert _codes(capped) == {
        "0/zeros.png": "UnsafeArchiveMember",
        "1/noise.bin": "UnsafeArchiveMember",
    }
    assert _codes(tarred) == {"1/noise.bin": "UnsafeArchiveMember"}
    for manifest in (capped, tarred):
        noise_reason = next(s.reason for s in manifest.skipped if s.path == "1/noise.bin")
        assert (
            "more than 100,000 bytes (imageops convert --max-archive-member-bytes)" in noise_reason
        )
        assert len(manifest.images) == 6
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no extraction left


def test_a_tar_that_inflates_past_the_ratio_is_refused_as_it_is_read(
    digits_raw: Path, tmp_path: Path
) -> None:
    src = _copy_classes(digits_raw, tmp_path / "src", per_class=2)
    archive = tmp_path / "zeros.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(src, arcname=".")
        for i in range(3):  # 3 x 8 MiB of zeros: about 25 KB gzipped
            info = tarfile.TarInfo(f"0/zeros{i}.png")
            info.size = 8 * 1024**2
            tf.addfile(info, io.BytesIO(bytes(info.size)))

    with pytest.raises(UnsafeArchiveError, match="unpacks to more than 200 times its size"):
        convert(archive, tmp_path / "out")
    allowed = convert(archive, tmp_path / "allowed", ConvertLimits(max_archive_ratio=10_000))

    assert _codes(allowed) == {f"0/zeros{i}.png": "NotAnImage" for i in range(3)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["allowed", "src", "zeros.tar.gz"]


def test_damaged_archives_are_refused(digits_raw: Path, tmp_path: Path) -> None:
    (tmp_path / "junk.zip").write_bytes(b"this is not a zip file")
    with pytest.raises(NoUsableImagesError, match="not a readable zip archive"):
        convert(tmp_path / "junk.zip", tmp_path / "out")

    archive = tmp_path / "cut.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(digits_raw / "0", arcname="0")
    archive.write_bytes(archive.read_bytes()[:200])  # a download cut short
    with pytest.raises(NoUsableImagesError, match="cut short"):
        convert(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()
