"""The digits sample: real scikit-learn scans written as an ImageFolder of RGB PNGs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tasks.data.sample import write_digits
from tasks.shared.errors import InvalidParameterError


def test_writes_an_imagefolder_of_real_digits(tmp_path: Path) -> None:
    dest = write_digits(tmp_path / "digits", size=12, classes=[3, 7], per_class=5)

    assert dest == tmp_path / "digits"
    assert sorted(p.name for p in dest.iterdir()) == ["3", "7"]
    for label in ("3", "7"):
        files = sorted((dest / label).glob("*.png"))
        assert len(files) == 5
        assert all(f.name.startswith(f"{label}_") for f in files)
    pixels = []
    for path in sorted(dest.rglob("*.png")):
        with Image.open(path) as img:
            assert img.format == "PNG"
            assert img.mode == "RGB"
            assert img.size == (12, 12)
            pixels.append(np.asarray(img))
    # Real scans: dark ink on white paper, and no two images alike.
    assert all(p.max() > 200 and p.min() < 100 for p in pixels)
    assert len({p.tobytes() for p in pixels}) == len(pixels)


def test_no_temporary_folder_is_left_behind(tmp_path: Path) -> None:
    write_digits(tmp_path / "digits", size=8, classes=[1], per_class=2)

    assert [p.name for p in tmp_path.iterdir()] == ["digits"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"size": 4}, "size must be >= 8"),
        ({"per_class": 0}, "per_class must be >= 1"),
        ({"classes": [10]}, "classes must be digits 0-9"),
        ({"classes": []}, "classes must be digits 0-9"),
    ],
)
def test_refuses_bad_parameters_before_writing(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidParameterError, match=message):
        write_digits(tmp_path / "digits", **kwargs)
    assert not (tmp_path / "digits").exists()
