"""Every image path a manifest.json lists is checked where every step reads it: read_manifest,
and iter_images for the steps that stream the list.

The hostile corpus drives the CLI (split, transform apply, train, score, export); these cases pin
the rule itself: which paths are refused, which odd but honest names still read, and that no
step reads a manifest around those two readers.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tasks.data.imagedir import ImageEntry, Manifest, read_manifest, write_manifest
from tasks.data.manifest_stream import iter_images
from tasks.shared.errors import InvalidImageDirectoryError

ROOT = Path(__file__).resolve().parents[1]


def _write(root: Path, *paths: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    entries = [ImageEntry(path=p, label=0, sha256="0" * 64, width=1, height=1) for p in paths]
    write_manifest(root, Manifest(labeled=True, classes=["0"], images=entries))
    return root


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("../../escaped/pwned.png", "'..' in the path"),
        ("0/../../x.png", "'..' in the path"),
        ("..", "'..' in the path"),
        ("0\\..\\..\\x.png", "'..' in the path"),
        ("/etc/passwd", "absolute path"),
        ("\\\\server\\share\\x.png", "absolute path"),
        ("C:/Windows/x.png", "absolute path"),
        ("c:x.png", "absolute path"),
        ("0/x\x00.png", "NUL byte"),
        ("", "empty path"),
        ("0//x.png", "normalised"),
        ("./0/x.png", "normalised"),
        ("0/", "normalised"),
    ],
)
@pytest.mark.parametrize("reader", [read_manifest, lambda root: list(iter_images(root))])
def test_a_manifest_path_that_could_leave_the_directory_is_refused(
    tmp_path: Path, path: str, says: str, reader
) -> None:
    root = _write(tmp_path / "images", "0/a.png", path)
    with pytest.raises(InvalidImageDirectoryError) as caught:
        reader(root)
    assert says in caught.value.message and repr(path) in caught.value.message
    assert "imageops convert" in caught.value.hint


def test_symlinks_leading_out_are_refused_and_links_inside_are_read(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "secret.png").write_bytes(b"x")
    root = tmp_path / "images"
    (root / "0").mkdir(parents=True)
    (root / "0" / "a.png").write_bytes(b"x")
    (root / "0" / "same.png").symlink_to(root / "0" / "a.png")  # inside: fine
    assert len(read_manifest(_write(root, "0/a.png", "0/same.png")).images) == 2

    (root / "0" / "out.png").symlink_to(outside / "secret.png")
    with pytest.raises(InvalidImageDirectoryError, match="symlink"):
        read_manifest(_write(root, "0/a.png", "0/out.png"))
    with pytest.raises(InvalidImageDirectoryError, match="symlink"):
        list(iter_images(root))

    (root / "1").symlink_to(outside)  # a class folder that is a link out
    with pytest.raises(InvalidImageDirectoryError, match="symlink"):
        read_manifest(_write(root, "0/a.png", "1/secret.png"))


def test_odd_but_honest_names_still_read(tmp_path: Path) -> None:
    names = ["0/a\\b.png", "0/..x.png", "0/x...png", "café/naïve 1.png", "0/ lead.png", "0/x:y.png"]
    assert [e.path for e in read_manifest(_write(tmp_path / "images", *names)).images] == names


def test_no_step_reads_a_manifest_around_read_manifest() -> None:
    """Only the two readers parse manifest.json, so their path check holds for every step."""
    parse = re.compile(r"Manifest\.model_validate|Manifest\.parse|Manifest\(\*\*")
    readers = [
        str(path.relative_to(ROOT))
        for folder in ("app", "flows", "tasks", "models")
        for path in (ROOT / folder).rglob("*.py")
        if parse.search(path.read_text())
    ]
    assert sorted(readers) == ["tasks/data/imagedir.py", "tasks/data/manifest_stream.py"]
