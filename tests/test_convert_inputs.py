"""Convert's other inputs and guarantees: CSV and COCO label files, every image mode, the cache.

Real images throughout (the digit scans, and images Pillow makes in each mode); no mocks. The
cache tests prove "no recomputation" by what a recomputation cannot avoid: it replaces ``dest``
(new inode, a temporary folder beside it, so the parent folder's mtime moves) and it decodes
every image (CPU time in this process, with ``workers=1``).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import struct
import time
import zipfile
import zlib
from pathlib import Path

import pytest
from PIL import Image

from tasks.data.convert import ConvertLimits, convert
from tasks.data.imagedir import MANIFEST, Manifest, load_rgb, read_manifest
from tasks.data.split import split
from tasks.data.versioning import version
from tasks.shared.errors import InvalidLabelFileError, NoUsableImagesError
from tasks.shared.settings import Settings


def _digits(src: Path, per_class: int = 3) -> list[Path]:
    """The first ``per_class`` scans of each digit class (digits_raw must not change)."""
    return [p for d in sorted(src.iterdir()) for p in sorted(d.glob("*.png"))[:per_class]]


def _codes(manifest: Manifest) -> dict[str, str]:
    return {s.path: s.reason.split(":", 1)[0] for s in manifest.skipped}


def _files_below(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def _write_csv(path: Path, rows: list[tuple[str, str]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as fh:
        fh.write("path,label\n")
        csv.writer(fh).writerows(rows)
    return path


# --- CSV manifests ------------------------------------------------------------------------------


@pytest.fixture
def photos(digits_raw: Path, tmp_path: Path) -> Path:
    """A user's folder: images in folders that are not classes, names that collide, a CSV later."""
    base = tmp_path / "photos"
    scans = _digits(digits_raw, per_class=2)
    for i, scan in enumerate(scans):  # 6 scans, two folders, the same names in both
        folder = base / ("day1" if i % 2 == 0 else "day2")
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(scan, folder / f"img{i // 2}.png")
    return base


def test_csv_manifest_becomes_a_labeled_image_directory(photos: Path, tmp_path: Path) -> None:
    outside = tmp_path / "secret.png"
    Image.new("RGB", (16, 16), (1, 2, 3)).save(outside)  # distinct content, outside the base
    (photos / "day1" / "link.png").symlink_to(outside)
    (photos / "day1" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    rows = [
        ("day1/img0.png", "zero"),
        ("day2/img0.png", "zero"),  # same file name as the one above: de-duplicated
        (r"day1\img1.png", " one "),  # a Windows path, a label with spaces around it
        ("./day2/img1.png", "one"),
        ("day1/img2.png", "two"),
        ("day1/img2.png", "two"),  # the same entry again
        ("day2/img2.png", "two"),
        ("day2/img2.png", "one"),  # ... and with a different label: refused
        ("day1/missing.png", "two"),
        ("../secret.png", "two"),
        (str(outside), "two"),
        ("day1/link.png", "two"),
        ("day1/broken.png", "two"),
        ("day1/img0.png", ""),  # no label while the others have one
        ("day2/img0.png", "a/b"),
    ]
    labels = _write_csv(photos / "labels.csv", rows)

    manifest = convert(labels, tmp_path / "out")

    assert manifest.labeled and manifest.classes == ["one", "two", "zero"]
    assert manifest.source == str(labels.resolve())
    assert {e.path: e.source_path for e in manifest.images} == {
        "one/img1.png": "day1/img1.png",
        "one/img1_1.png": "day2/img1.png",
        "two/img2.png": "day1/img2.png",
        "zero/img0.png": "day1/img0.png",
        "zero/img0_1.png": "day2/img0.png",
    }
    assert manifest.counts == {"one": 2, "two": 1, "zero": 2}
    out = tmp_path / "out"
    for entry in manifest.images:
        assert (out / entry.path).read_bytes() == (photos / entry.source_path).read_bytes()
        assert manifest.classes[entry.label] == entry.path.split("/")[0]
        assert entry.size == (out / entry.path).stat().st_size
    assert _files_below(out) == {e.path for e in manifest.images} | {MANIFEST}
    assert _codes(manifest) == {
        "day1/img2.png": "DuplicateEntry",
        "day2/img2.png": "MultipleLabels",
        "day1/missing.png": "MissingFile",
        "../secret.png": "UnsafePath",
        str(outside): "UnsafePath",
        "day1/link.png": "UnsafePath",
        "day1/broken.png": "UnreadableImage",
        "day1/img0.png": "MissingLabel",
        "day2/img0.png": "BadLabel",
    }
    reasons = {s.path: s.reason for s in manifest.skipped}
    assert "line 7" in reasons["day1/img2.png"] and "line 15" in reasons["day1/img0.png"]
    assert "line 8 (two), line 9 (one)" in reasons["day2/img2.png"]
    assert "symlink" in reasons["day1/link.png"] and "absolute" in reasons[str(outside)]
    assert read_manifest(out) == manifest.whole()


def test_csv_row_order_does_not_change_the_directory(photos: Path, tmp_path: Path) -> None:
    rows = [(f"{day}/img{i}.png", f"c{i}") for day in ("day1", "day2") for i in range(3)]
    forward = convert(_write_csv(photos / "forward.csv", rows), tmp_path / "forward")
    backward = convert(_write_csv(photos / "backward.csv", rows[::-1]), tmp_path / "backward")

    assert forward.images == backward.images
    assert [e.path for e in forward.images] == [
        "c0/img0.png", "c0/img0_1.png", "c1/img1.png", "c1/img1_1.png",
        "c2/img2.png", "c2/img2_1.png",
    ]  # fmt: skip


def test_csv_names_taken_already_are_not_reused(photos: Path, tmp_path: Path) -> None:
    shutil.copyfile(photos / "day2" / "img2.png", photos / "day1" / "img0_1.png")
    rows = [("day1/img0.png", "x"), ("day2/img0.png", "x"), ("day1/img0_1.png", "x")]
    manifest = convert(_write_csv(photos / "labels.csv", rows), tmp_path / "out")

    assert {e.source_path: e.path for e in manifest.images} == {
        "day1/img0.png": "x/img0.png",
        "day1/img0_1.png": "x/img0_1.png",  # its own name, kept
        "day2/img0.png": "x/img0_2.png",
    }


def test_csv_without_labels_is_unlabeled_and_flat(photos: Path, tmp_path: Path) -> None:
    labels = photos / "score.csv"
    labels.write_text("\ufeffPath,Label\n\nday1/img0.png,\nday2/img0.png,\n", encoding="utf-8")

    manifest = convert(labels, tmp_path / "out")

    assert not manifest.labeled and manifest.classes == []
    assert [e.path for e in manifest.images] == ["img0.png", "img0_1.png"]
    assert all(e.label is None for e in manifest.images)


def test_csv_listing_nothing_usable_raises(photos: Path, tmp_path: Path) -> None:
    labels = _write_csv(photos / "labels.csv", [("nope.png", "a")])
    with pytest.raises(NoUsableImagesError, match="1 MissingFile"):
        convert(labels, tmp_path / "out")
    empty = _write_csv(photos / "empty.csv", [])
    with pytest.raises(NoUsableImagesError, match="lists no files"):
        convert(empty, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty"),
        (
            b"day1/img0.png,zero\n",
            r"line 1: the header 'day1/img0.png,zero' names no column 'path'",
        ),
        (b"path,name\nday1/img0.png,zero\n", "line 1: .*names no column 'label'"),
        (b"path,label\nday1/img0.png,zero\nday1/img1.png,one,extra\n", "line 3: 3 field"),
        (b"path,label\nday1/img0.png,zero\n,one\n", "line 3: the path is empty"),
        (b"path,label\nday1/img0.png,zero\nday1/img1.png,\xe9t\xe9\n", "line 3: not UTF-8"),
        (b'path,label\n"day1/img0.png"x,zero\n', "line 2: ',' expected"),
    ],
)
def test_malformed_csv_names_the_line(
    photos: Path, tmp_path: Path, content: bytes, message: str
) -> None:
    labels = photos / "labels.csv"
    labels.write_bytes(content)

    with pytest.raises(InvalidLabelFileError, match=message) as err:
        convert(labels, tmp_path / "out")

    assert err.value.hint  # and says what to do
    assert not (tmp_path / "out").exists()


# --- COCO ---------------------------------------------------------------------------------------


def _coco(images: list, annotations: list, categories: list) -> dict:
    return {"images": images, "annotations": annotations, "categories": categories}


def test_coco_classification_json(photos: Path, tmp_path: Path) -> None:
    images = [
        {"id": 1, "file_name": "day1/img0.png"},
        {"id": 2, "file_name": "day2/img0.png"},
        {"id": 3, "file_name": "day1/img1.png"},
        {"id": 4, "file_name": "day2/img1.png"},  # two categories: refused
        {"id": 5, "file_name": "day1/img2.png"},  # an unknown category: refused
        {"id": 6, "file_name": "day2/img2.png"},  # no annotation in a labeled set
        {"id": 7, "file_name": "../outside.png"},
        {"id": 8, "file_name": "day1/gone.png"},
    ]
    annotations = [
        {"id": 10, "image_id": 1, "category_id": 30},
        {"id": 11, "image_id": 2, "category_id": 30},
        {"id": 12, "image_id": 3, "category_id": 20},
        {"id": 13, "image_id": 3, "category_id": 20},  # the same category twice is one label
        {"id": 14, "image_id": 4, "category_id": 20},
        {"id": 15, "image_id": 4, "category_id": 30},
        {"id": 16, "image_id": 5, "category_id": 99},
        {"id": 17, "image_id": 7, "category_id": 20},
        {"id": 18, "image_id": 8, "category_id": 20},
    ]
    categories = [
        {"id": 30, "name": "cat"},
        {"id": 20, "name": "bird"},
        {"id": 40, "name": "dog"},  # no image at all
    ]
    coco = photos / "annotations.json"
    coco.write_text(json.dumps(_coco(images, annotations, categories)))

    manifest = convert(coco, tmp_path / "out")

    assert manifest.classes == ["bird", "cat"]  # sorted by name, not by category id
    assert {e.path: (e.label, e.source_path) for e in manifest.images} == {
        "bird/img1.png": (0, "day1/img1.png"),
        "cat/img0.png": (1, "day1/img0.png"),
        "cat/img0_1.png": (1, "day2/img0.png"),
    }
    assert _codes(manifest) == {
        "day2/img1.png": "MultipleLabels",
        "day1/img2.png": "UnknownCategory",
        "day2/img2.png": "MissingLabel",
        "../outside.png": "UnsafePath",
        "day1/gone.png": "MissingFile",
        "dog/": "EmptyClass",
    }
    reasons = {s.path: s.reason for s in manifest.skipped}
    assert "bird (annotations[4]), cat (annotations[5])" in reasons["day2/img1.png"]
    assert "category 99" in reasons["day1/img2.png"]
    assert (tmp_path / "out" / "cat" / "img0_1.png").read_bytes() == (
        photos / "day2" / "img0.png"
    ).read_bytes()


def test_coco_without_annotations_is_unlabeled(photos: Path, tmp_path: Path) -> None:
    coco = photos / "test.json"  # COCO test sets list the images only
    coco.write_text(json.dumps({"images": [{"id": 1, "file_name": "day1/img0.png"}]}))

    manifest = convert(coco, tmp_path / "out")

    assert not manifest.labeled and [e.path for e in manifest.images] == ["img0.png"]


_IMAGE = {"id": 1, "file_name": "day1/img0.png"}
_CATEGORY = {"id": 1, "name": "zero"}


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ('{"images": [\n  {"id": 1,}\n]}', "line 2, column 12: not valid JSON"),
        ([_IMAGE], "the top level is a list, not an object"),
        ({"annotations": []}, "`images` is missing"),
        (_coco([{"id": 1, "file_name": 7}], [], []), r"images\[0\].file_name is the number 7"),
        (_coco([_IMAGE, {"id": 1, "file_name": "x.png"}], [], []), r"images\[1\].id 1 is the id"),
        (_coco([_IMAGE], [{"image_id": 2, "category_id": 1}], [_CATEGORY]), "not the id of any"),
        (_coco([_IMAGE], [{"image_id": 1}], [_CATEGORY]), r"annotations\[0\] has no `category_id`"),
        (_coco([_IMAGE], [], [_CATEGORY, {"id": 2, "name": "zero"}]), r"categories\[1\].name"),
        (_coco([_IMAGE], [], [{"id": True, "name": "zero"}]), r"categories\[0\].id is true/false"),
        ({"images": {}}, "`images` is an object, not a list"),
        (_coco(["img0.png"], [], []), r"images\[0\] is a string, not an object"),
        (_coco([{"id": 1, "file_name": " "}], [], []), r"images\[0\].file_name is an empty string"),
        (_coco([{}], [], []), r"images\[0\] has no `id`"),  # the first field, as written
    ],
)
def test_malformed_coco_names_the_field(
    photos: Path, tmp_path: Path, document: object, message: str
) -> None:
    coco = photos / "annotations.json"
    coco.write_text(document if isinstance(document, str) else json.dumps(document))

    with pytest.raises(InvalidLabelFileError, match=message) as err:
        convert(coco, tmp_path / "out")

    assert err.value.hint
    assert not (tmp_path / "out").exists()


# --- every image mode loads as RGB --------------------------------------------------------------


def _png_rgb16(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A 48-bit (16 bits per channel) RGB PNG, written by hand: Pillow cannot write one."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    row = b"\x00" + struct.pack(">HHH", *rgb) * width
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(row * height))
        + chunk(b"IEND", b"")
    )


def _image_modes(folder: Path) -> dict[str, tuple[tuple[int, int], tuple[int, int, int]]]:
    """Write one image per mode; return name -> (pixel to look at, the RGB it must load as)."""
    folder.mkdir(parents=True)
    expected = {}

    gray = Image.new("L", (20, 10), 77)
    gray.save(folder / "gray.png")
    expected["gray.png"] = ((3, 3), (77, 77, 77))

    palette = Image.new("P", (20, 10), 1)
    palette.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    palette.save(folder / "palette.png")
    expected["palette.png"] = ((3, 3), (10, 200, 30))

    clear = palette.copy()
    clear.putpixel((0, 0), 0)
    clear.save(folder / "palette_transparent.png", transparency=0)  # index 0 is see-through
    expected["palette_transparent.png"] = ((0, 0), (255, 255, 255))  # on white
    expected["palette_transparent.png#opaque"] = ((3, 3), (10, 200, 30))

    rgba = Image.new("RGBA", (20, 10), (200, 100, 50, 255))
    rgba.putpixel((0, 0), (200, 100, 50, 0))
    rgba.putpixel((1, 0), (0, 0, 0, 128))
    rgba.save(folder / "rgba.png")
    expected["rgba.png"] = ((0, 0), (255, 255, 255))
    expected["rgba.png#opaque"] = ((3, 3), (200, 100, 50))
    expected["rgba.png#half"] = ((1, 0), (127, 127, 127))

    gray_alpha = Image.new("LA", (20, 10), (40, 255))
    gray_alpha.save(folder / "gray_alpha.png")
    expected["gray_alpha.png"] = ((3, 3), (40, 40, 40))

    cmyk = Image.new("CMYK", (20, 10), (0, 255, 255, 0))  # pure red in ink
    cmyk.save(folder / "cmyk.tif")
    expected["cmyk.tif"] = ((3, 3), (255, 0, 0))
    cmyk.save(folder / "cmyk.jpg", quality=95)
    expected["cmyk.jpg"] = ((3, 3), (255, 0, 0))

    # 16-bit gray: 40000 of 65535 must load as 156 of 255, not clip to 255 (and 200 as 1, not 200).
    deep = Image.new("I;16", (20, 10), 40000)
    deep.putpixel((0, 0), 200)
    deep.save(folder / "gray16.png")
    deep.save(folder / "gray16.tif")
    expected["gray16.png"] = ((3, 3), (156, 156, 156))
    expected["gray16.png#dark"] = ((0, 0), (1, 1, 1))
    expected["gray16.tif"] = ((3, 3), (156, 156, 156))
    big_endian = Image.new("I;16B", (20, 10), 65535)
    big_endian.save(folder / "gray16be.tiff")
    expected["gray16be.tiff"] = ((3, 3), (255, 255, 255))

    (folder / "rgb48.png").write_bytes(_png_rgb16(20, 10, (65535, 32768, 0)))
    expected["rgb48.png"] = ((3, 3), (255, 128, 0))

    bilevel = Image.new("1", (20, 10), 1)
    bilevel.save(folder / "bilevel.png")
    expected["bilevel.png"] = ((3, 3), (255, 255, 255))
    return expected


def test_every_image_mode_converts_and_loads_as_rgb(tmp_path: Path) -> None:
    expected = _image_modes(tmp_path / "src" / "modes")
    modes = {p.name: Image.open(p).mode for p in (tmp_path / "src" / "modes").iterdir()}
    assert {"L", "P", "RGBA", "LA", "CMYK", "I;16", "I;16B", "RGB", "1"} <= set(modes.values())

    manifest = convert(tmp_path / "src", tmp_path / "out")

    assert manifest.skipped == []
    assert len(manifest.images) == len(modes)
    for key, (xy, rgb) in expected.items():
        path = tmp_path / "out" / "modes" / key.split("#")[0]
        image = load_rgb(path)
        assert image.mode == "RGB" and image.size == (20, 10), key
        got = image.getpixel(xy)
        tolerance = 3 if path.suffix == ".jpg" else 1  # JPEG is lossy; alpha blends round
        assert all(abs(a - b) <= tolerance for a, b in zip(got, rgb, strict=True)), (key, got)


# --- the cache ----------------------------------------------------------------------------------


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of the folder and of everything below it."""
    paths = [folder, *sorted(folder.rglob("*"))]
    return {
        p.relative_to(folder).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths
    }


def _heavy_source(digits_raw: Path, src: Path) -> Path:
    """Scans in class folders, plus large plain images: a few KB to hash, 0.1 s each to decode."""
    for scan in _digits(digits_raw, per_class=3):
        (src / scan.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(scan, src / scan.parent.name / scan.name)
    for i in range(3):
        Image.new("L", (4000, 4000), 200 + i).save(src / "0" / f"big{i}.png")
    return src


def _timed(**kwargs: object) -> tuple[Manifest, float]:
    started = time.process_time()
    manifest = convert(workers=1, **kwargs)  # in this process, so its CPU time counts here
    return manifest, time.process_time() - started


def test_unchanged_source_is_a_cache_hit(digits_raw: Path, tmp_path: Path) -> None:
    src = _heavy_source(digits_raw, tmp_path / "src")
    dest = tmp_path / "data" / "images"
    first, converting = _timed(source=src, dest=dest)
    before, parent = _snapshot(dest), dest.parent.stat().st_mtime_ns
    assert first.fingerprint and len(first.fingerprint) == 64

    again, hit = _timed(source=src, dest=dest)
    # Same bytes, new timestamps (a fresh checkout, `cp` without -p): still the same data.
    for path in src.rglob("*.png"):
        os.utime(path, ns=(time.time_ns(), time.time_ns()))
    touched, touched_hit = _timed(source=src, dest=dest)

    assert again.whole() == touched.whole() == first.whole() == read_manifest(dest)
    # Nothing written: not a file, not the folder (a conversion replaces it: new inode), and no
    # temporary folder beside it (creating one would move the parent's mtime).
    assert _snapshot(dest) == before
    assert dest.parent.stat().st_mtime_ns == parent
    assert sorted(p.name for p in dest.parent.iterdir()) == ["images"]
    # Nothing decoded: converting decodes three 4000x4000 images; the hit only hashes bytes.
    assert hit < converting / 5 and touched_hit < converting / 5, (converting, hit, touched_hit)


def test_a_changed_source_converts_again(digits_raw: Path, tmp_path: Path) -> None:
    src = _heavy_source(digits_raw, tmp_path / "src")
    for big in src.rglob("big*.png"):
        big.unlink()  # speed is not the point here
    dest = tmp_path / "images"
    first = convert(src, dest).whole()  # what it wrote, before it is written again

    def reconverted() -> Manifest:
        inode = dest.stat().st_ino
        manifest = convert(src, dest)
        assert dest.stat().st_ino != inode  # a new directory replaced the old one
        assert read_manifest(dest) == manifest.whole()
        return manifest

    # One image edited in place, same name: its new bytes are in the new directory.
    edited = sorted((src / "1").iterdir())[0]
    with Image.open(edited) as img:
        img.rotate(90).save(edited)
    changed = reconverted()
    rel = f"1/{edited.name}"
    new_sha = {e.path: e.sha256 for e in changed.images}[rel]
    assert new_sha != {e.path: e.sha256 for e in first.images}[rel]
    assert (dest / rel).read_bytes() == edited.read_bytes()
    assert changed.fingerprint != first.fingerprint

    # One image added.
    shutil.copyfile(_digits(digits_raw, per_class=5)[-1], src / "2" / "new.png")
    added = reconverted()
    assert "2/new.png" in {e.path for e in added.images}


def test_changed_parameters_or_a_damaged_dest_convert_again(
    digits_raw: Path, tmp_path: Path
) -> None:
    src = _heavy_source(digits_raw, tmp_path / "src")
    dest = tmp_path / "images"
    first = convert(src, dest, workers=1)

    # A smaller pixel limit refuses the big images: it must not be answered from the cache.
    limited = convert(src, dest, ConvertLimits(max_pixels=1_000_000), workers=1)
    assert {s.path for s in limited.skipped} == {f"0/big{i}.png" for i in range(3)}
    assert limited.fingerprint != first.fingerprint

    # A file lost from dest (or changed in size) is put back.
    convert(src, dest, workers=1)
    (dest / "1" / sorted(p.name for p in (dest / "1").iterdir())[0]).unlink()
    inode = dest.stat().st_ino
    restored = convert(src, dest, workers=1)
    assert dest.stat().st_ino != inode
    assert _files_below(dest) == {e.path for e in restored.images} | {MANIFEST}

    # A stray file in dest: the directory is no longer what the manifest says.
    (dest / "1" / "stray.png").write_bytes(b"x")
    inode = dest.stat().st_ino
    convert(src, dest, workers=1)
    assert dest.stat().st_ino != inode and not (dest / "1" / "stray.png").exists()


def test_archive_and_label_file_cache_hits(digits_raw: Path, tmp_path: Path) -> None:
    scans = _digits(digits_raw, per_class=2)
    archive = tmp_path / "digits.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for scan in scans:
            zf.write(scan, f"{scan.parent.name}/{scan.name}")
    dest = tmp_path / "out" / "from_zip"
    first = convert(archive, dest)
    before, parent = _snapshot(dest), dest.parent.stat().st_mtime_ns

    assert convert(archive, dest) == first
    # Not even extracted: that would have made a temporary folder beside dest.
    assert _snapshot(dest) == before and dest.parent.stat().st_mtime_ns == parent

    with zipfile.ZipFile(archive, "a") as zf:
        zf.write(scans[0], "2/added.png")
    assert len(convert(archive, dest).images) == len(first.images) + 1

    # A CSV names files beside it: an image that changes under an unchanged CSV is a change.
    base = tmp_path / "listed"
    base.mkdir()
    for i, scan in enumerate(scans[:4]):
        shutil.copyfile(scan, base / f"{i}.png")
    labels = _write_csv(base / "labels.csv", [(f"{i}.png", f"c{i % 2}") for i in range(4)])
    dest = tmp_path / "out" / "from_csv"
    listed = convert(labels, dest)
    before = _snapshot(dest)
    assert convert(labels, dest) == listed and _snapshot(dest) == before
    shutil.copyfile(scans[5], base / "3.png")
    changed = convert(labels, dest)
    assert changed.fingerprint != listed.fingerprint
    assert (dest / "c1" / "3.png").read_bytes() == scans[5].read_bytes()


def test_same_images_elsewhere_give_the_same_directory(digits_raw: Path, tmp_path: Path) -> None:
    """The fingerprint has no timestamps: a fresh copy of the images converts byte for byte the
    same, so its DVC version (the md5 of these bytes) is the same too."""
    src = tmp_path / "src"
    for scan in _digits(digits_raw, per_class=2):
        (src / scan.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(scan, src / scan.parent.name / scan.name)
    one = convert(src, tmp_path / "one")
    time.sleep(0.01)
    for path in src.rglob("*.png"):  # the same bytes written again: new mtimes, new inodes
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data)
    two = convert(src, tmp_path / "two")

    assert one == two
    for rel in _files_below(tmp_path / "one"):
        assert (tmp_path / "one" / rel).read_bytes() == (tmp_path / "two" / rel).read_bytes()


def test_split_outputs_carry_no_fingerprint(digits_raw: Path, tmp_path: Path) -> None:
    manifest = convert(digits_raw, tmp_path / "images")
    train, val = split(tmp_path / "images", tmp_path / "train", tmp_path / "val", fraction=0.5)

    assert manifest.fingerprint is not None
    assert train.fingerprint is None and val.fingerprint is None
    assert all(e.size is not None for e in train.images)


def test_a_manifest_without_a_fingerprint_is_converted_again(
    digits_raw: Path, tmp_path: Path
) -> None:
    """Directories written before the cache existed are not trusted: they convert again."""
    src = tmp_path / "src"
    for scan in _digits(digits_raw, per_class=1):
        (src / scan.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(scan, src / scan.parent.name / scan.name)
    dest = tmp_path / "images"
    manifest = convert(src, dest).whole()
    old = json.loads((dest / MANIFEST).read_text())
    del old["fingerprint"]
    for entry in old["images"]:  # fields a manifest of format version 1 did not have yet
        entry.pop("size")
        entry.pop("source_path", None)  # written only when the image came from elsewhere
    (dest / MANIFEST).write_text(json.dumps(old))
    inode = dest.stat().st_ino

    assert read_manifest(dest).fingerprint is None  # an older manifest still reads
    assert convert(src, dest).whole() == manifest
    assert dest.stat().st_ino != inode


def test_converting_again_keeps_the_dvc_version(digits_raw: Path, project: Settings) -> None:
    """A cache hit leaves the directory as it was, so DVC sees the same data: the same md5."""
    src = project.project_root / "raw"
    for scan in _digits(digits_raw, per_class=2):
        (src / scan.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(scan, src / scan.parent.name / scan.name)
    dest = project.data_path / "images"
    convert(src, dest)
    first = version(dest, project)

    convert(src, dest)
    shutil.rmtree(dest)  # gone: converted afresh from the same bytes, with new timestamps
    for path in src.rglob("*.png"):
        os.utime(path, ns=(time.time_ns(), time.time_ns()))
    convert(src, dest)

    assert version(dest, project) == first


def test_coco_nesting_is_capped_but_brackets_in_names_and_polygons_pass(
    photos: Path, tmp_path: Path
) -> None:
    """The depth check counts structure only: brackets (and escaped quotes) inside strings do
    not count, and COCO's own deepest field (segmentation polygons) is well inside the cap."""
    from models.bounded_parse import MAX_DEPTH

    odd = photos / "day1" / 'img[[[{"0.png'  # brackets and a quote in a real file name
    shutil.copy(photos / "day1" / "img0.png", odd)
    images = [{"id": 1, "file_name": f"day1/{odd.name}", "note": "[" * 100}]
    polygon = {"id": 10, "image_id": 1, "category_id": 1, "segmentation": [[1.0, 2.0, 3.0]]}
    coco = photos / "annotations.json"
    document = _coco(images, [polygon], [{"id": 1, "name": "cat"}])
    document["info"] = json.loads("[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1))
    coco.write_text(json.dumps(document))
    assert [e.source_path for e in convert(coco, tmp_path / "out").images] == [f"day1/{odd.name}"]

    document["info"] = [document["info"]]  # one level more than the cap
    coco.write_text(json.dumps(document))
    with pytest.raises(InvalidLabelFileError, match=f"nested {MAX_DEPTH + 1} deep"):
        convert(coco, tmp_path / "again")
    assert not (tmp_path / "again").exists()
