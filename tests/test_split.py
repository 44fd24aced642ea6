"""Split Image Directory: stratified, seeded, rounded down per class, both halves share classes."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from tasks.data.convert import convert
from tasks.data.imagedir import MANIFEST, Manifest, read_manifest
from tasks.data.sample import write_digits
from tasks.data.split import split
from tasks.shared.errors import InvalidImageDirectoryError, InvalidParameterError


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory, digits_raw: Path) -> Path:
    """The 3 x 30 digits as an ImageDirectory, shared by the tests here (read only)."""
    return _convert(digits_raw, tmp_path_factory.mktemp("split") / "images")


def _convert(source: Path, dest: Path) -> Path:
    convert(source, dest)
    return dest


def _paths(manifest: Manifest) -> list[str]:
    return [e.path for e in manifest.images]


def test_stratified_counts_and_a_partition(digits_split: tuple[Path, Path], images: Path) -> None:
    train_dir, val_dir = digits_split
    train, val = read_manifest(train_dir), read_manifest(val_dir)
    whole = read_manifest(images)

    assert train.counts == {"0": 24, "1": 24, "2": 24}  # 0.8 x 30 per class
    assert val.counts == {"0": 6, "1": 6, "2": 6}
    assert train.classes == val.classes == whole.classes
    assert set(_paths(train)).isdisjoint(_paths(val))
    assert sorted(_paths(train) + _paths(val)) == sorted(_paths(whole))
    by_path = {e.path: e for e in whole.images}
    for folder, manifest in ((train_dir, train), (val_dir, val)):
        assert all(by_path[e.path] == e for e in manifest.images)  # labels and hashes carried
        files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
        assert files == set(_paths(manifest)) | {MANIFEST}
        assert manifest.skipped == []


def test_same_seed_same_split_other_seed_other_split(images: Path, tmp_path: Path) -> None:
    a, _ = split(images, tmp_path / "a1", tmp_path / "a2", fraction=0.5, seed=7)
    b, _ = split(images, tmp_path / "b1", tmp_path / "b2", fraction=0.5, seed=7)
    c, _ = split(images, tmp_path / "c1", tmp_path / "c2", fraction=0.5, seed=8)

    assert _paths(a) == _paths(b)
    assert read_manifest(tmp_path / "a1") == read_manifest(tmp_path / "b1")
    assert _paths(a) != _paths(c)
    assert a.counts == c.counts == {"0": 15, "1": 15, "2": 15}


def test_rounds_down_per_class_without_float_noise(tmp_path: Path) -> None:
    # 0.29 * 100 is 28.999999999999996 in floating point: the share must still be 29.
    raw = write_digits(tmp_path / "raw", size=8, classes=[4], per_class=100)
    source = _convert(raw, tmp_path / "images")

    first, second = split(source, tmp_path / "first", tmp_path / "second", fraction=0.29)
    odd_first, odd_second = split(
        source, tmp_path / "odd1", tmp_path / "odd2", fraction=0.335, seed=3
    )

    assert (first.counts, second.counts) == ({"4": 29}, {"4": 71})
    assert (odd_first.counts, odd_second.counts) == ({"4": 33}, {"4": 67})  # 33.5 -> 33


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_fraction_at_the_ends_leaves_one_side_empty_but_keeps_classes(
    images: Path, tmp_path: Path, fraction: float
) -> None:
    first, second = split(images, tmp_path / "first", tmp_path / "second", fraction=fraction)

    assert len(first.images) == 90 * fraction
    assert len(second.images) == 90 * (1 - fraction)
    assert first.classes == second.classes == ["0", "1", "2"]
    assert read_manifest(tmp_path / "first").classes == ["0", "1", "2"]


@pytest.mark.parametrize("fraction", [-0.1, 1.5, math.nan])
def test_fraction_out_of_range_is_refused_before_any_work(
    images: Path, tmp_path: Path, fraction: float
) -> None:
    with pytest.raises(InvalidParameterError, match="fraction must be between 0 and 1"):
        split(images, tmp_path / "first", tmp_path / "second", fraction=fraction)
    assert list(tmp_path.iterdir()) == []


def test_unlabeled_directory_is_split_as_one_group(digits_raw: Path, tmp_path: Path) -> None:
    flat = tmp_path / "flat"
    flat.mkdir()
    for path in sorted(digits_raw.rglob("*.png"))[:10]:
        shutil.copyfile(path, flat / path.name)
    source = _convert(flat, tmp_path / "images")

    first, second = split(source, tmp_path / "first", tmp_path / "second", fraction=0.7)

    assert (len(first.images), len(second.images)) == (7, 3)
    assert not first.labeled and not second.labeled
    assert all(e.label is None for e in first.images + second.images)


def test_duplicates_are_recounted_per_half(digits_raw: Path, tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for label in ("0", "1"):
        (raw / label).mkdir(parents=True)
        for path in sorted((digits_raw / label).glob("*.png"))[:4]:
            shutil.copyfile(path, raw / label / path.name)
    twin = sorted((raw / "0").iterdir())[0]
    shutil.copyfile(twin, raw / "0" / "twin.png")
    source = _convert(raw, tmp_path / "images")
    assert read_manifest(source).duplicates == [[f"0/{twin.name}", "0/twin.png"]]

    first, second = split(source, tmp_path / "first", tmp_path / "second", fraction=1.0)

    assert first.duplicates == [[f"0/{twin.name}", "0/twin.png"]]
    assert second.duplicates == []


def test_outputs_overlapping_the_source_or_each_other_are_refused(
    images: Path, tmp_path: Path
) -> None:
    before = read_manifest(images)
    for first, second in (
        (images, tmp_path / "val"),
        (tmp_path / "train", images / "val"),
        (tmp_path / "same", tmp_path / "same"),
        (tmp_path / "outer", tmp_path / "outer" / "inner"),
    ):
        with pytest.raises(InvalidParameterError, match="overlap"):
            split(images, first, second)
    assert read_manifest(images) == before
    assert list(tmp_path.iterdir()) == []


def test_source_must_be_an_image_directory(digits_raw: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidImageDirectoryError, match=r"manifest\.json is missing"):
        split(digits_raw, tmp_path / "first", tmp_path / "second")


def test_an_optional_third_output_takes_its_share_of_each_class(
    digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    source = digits_split[0]  # 24 images per class
    two = split(source, tmp_path / "a2", tmp_path / "b2", fraction=0.5, seed=3)
    three = split(
        source,
        tmp_path / "a3",
        tmp_path / "b3",
        fraction=0.5,
        seed=3,
        third=tmp_path / "c3",
        third_fraction=0.25,
    )
    assert len(three) == 3
    first, second, test = three
    assert first.images == two[0].images  # the first output does not move when a third is asked
    assert [first.counts[c] for c in first.classes] == [12, 12, 12]
    assert [test.counts[c] for c in test.classes] == [6, 6, 6]
    assert [second.counts[c] for c in second.classes] == [6, 6, 6]
    paths = [{e.path for e in m.images} for m in three]
    assert not (paths[0] & paths[1] or paths[0] & paths[2] or paths[1] & paths[2])
    assert set().union(*paths) == {e.path for e in read_manifest(source).images}
    for manifest, folder in zip(three, ("a3", "b3", "c3"), strict=True):
        assert read_manifest(tmp_path / folder) == manifest.whole()
        assert manifest.classes == first.classes


def test_third_output_fractions_are_checked(
    digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    source = digits_split[0]
    with pytest.raises(InvalidParameterError, match="more than 1"):
        split(source, tmp_path / "a", tmp_path / "b", fraction=0.8, third=tmp_path / "c",
              third_fraction=0.3)  # fmt: skip
    with pytest.raises(InvalidParameterError, match="needs a third output"):
        split(source, tmp_path / "a", tmp_path / "b", third_fraction=0.1)
    with pytest.raises(InvalidParameterError, match="first and third outputs"):
        split(source, tmp_path / "a", tmp_path / "b", third=tmp_path / "a", third_fraction=0.1)
    assert not any(tmp_path.iterdir())
