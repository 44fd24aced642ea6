"""manifest.json read and written one image at a time: the layout, older layouts, memory, and
what a crash or a rewrite leaves."""

from __future__ import annotations

import hashlib
import json
import os
import tracemalloc
from pathlib import Path

import pytest

from tasks.data.imagedir import MANIFEST, ImageEntry, Manifest, read_manifest, write_manifest
from tasks.data.manifest_stream import (
    ManifestWriter,
    content_digest,
    count_images,
    iter_images,
    read_head,
)
from tasks.shared.errors import InvalidImageDirectoryError


def _entries(n: int, same_every: int = 0) -> list[ImageEntry]:
    """``n`` entries over two classes; with ``same_every``, that many share each content."""
    return [
        ImageEntry(
            path=f"{'ab'[i % 2]}/{i:06d}.png",
            label=i % 2,
            sha256=hashlib.sha256(str(i // same_every if same_every else i).encode()).hexdigest(),
            width=8,
            height=8,
            size=3,
        )
        for i in range(n)
    ]


def _manifest(entries: list[ImageEntry]) -> Manifest:
    counts = {c: sum(1 for e in entries if e.label == i) for i, c in enumerate("ab")}
    return Manifest(labeled=True, classes=["a", "b"], counts=counts, images=entries, source="s")


def _with_files(root: Path, entries: list[ImageEntry]) -> Path:
    for entry in entries:
        (root / entry.path).parent.mkdir(parents=True, exist_ok=True)
        (root / entry.path).write_bytes(b"abc")
    return root


def test_the_writer_writes_what_write_manifest_writes_and_finds_the_duplicates(
    tmp_path: Path,
) -> None:
    entries = _entries(9, same_every=3)  # three groups of three identical images
    whole = _manifest(entries)
    whole.duplicates = [
        sorted(e.path for e in entries if e.sha256 == entries[k].sha256) for k in (0, 3, 6)
    ]
    (tmp_path / "whole").mkdir()
    (tmp_path / "streamed").mkdir()
    write_manifest(tmp_path / "whole", whole)
    with ManifestWriter(tmp_path / "streamed") as writer:
        for entry in entries:
            writer.add(entry)
        written = writer.finish(whole.head())

    assert (tmp_path / "streamed" / MANIFEST).read_bytes() == (
        tmp_path / "whole" / MANIFEST
    ).read_bytes()
    assert written.counts == {"a": 5, "b": 4} and written.image_count == 9
    assert sorted(os.listdir(tmp_path / "streamed")) == [MANIFEST]  # no scratch file left
    text = (tmp_path / "streamed" / MANIFEST).read_text()
    assert text.endswith('"size":3}\n  ]\n}\n')  # the list last, one line per image
    assert json.loads(text)["images"][4]["path"] == entries[4].path  # plain JSON still


def test_the_head_is_read_without_the_list_and_a_bad_line_is_named(tmp_path: Path) -> None:
    entries = _entries(5)
    write_manifest(_with_files(tmp_path, entries), _manifest(entries))
    path = tmp_path / MANIFEST
    lines = path.read_text().splitlines(keepends=True)
    third = next(i for i, line in enumerate(lines) if entries[2].path in line)
    lines[third] = '    {"path": "a/000002.png", "label": "not a number"},\n'
    path.write_text("".join(lines))

    head = read_head(tmp_path)  # stops at the list: the broken line is never parsed
    assert (head.classes, head.counts, head.source) == (["a", "b"], {"a": 3, "b": 2}, "s")
    with pytest.raises(InvalidImageDirectoryError, match="image 3 of its list"):
        list(iter_images(tmp_path))


@pytest.mark.parametrize("layout", ["list in the middle", "indented entries", "edited by hand"])
def test_manifests_written_before_still_read(tmp_path: Path, layout: str) -> None:
    entries = _entries(6)
    manifest = _manifest(entries)
    record = manifest.model_dump(mode="json", exclude_defaults=False)
    if layout == "list in the middle":  # as imageops wrote it before the list moved last
        images = record.pop("images")
        head = json.dumps(record, indent=2)
        lines = ",\n    ".join(json.dumps(e, separators=(",", ":")) for e in images)
        text = head.replace('\n  "source"', f'\n  "images": [\n    {lines}\n  ],\n  "source"')
    elif layout == "indented entries":  # older still: every entry over eight lines
        text = json.dumps(record, indent=2)
    else:  # the streaming layout, one entry split over two lines part way down the list
        write_manifest(tmp_path, manifest)
        text = (tmp_path / MANIFEST).read_text()
        text = text.replace('    {"path":"a/000004.png"', '    {\n"path":"a/000004.png"')
    (_with_files(tmp_path, entries) / MANIFEST).write_text(text)

    assert read_head(tmp_path) == manifest.head()
    assert list(iter_images(tmp_path)) == entries
    assert count_images(tmp_path) == 6
    assert read_manifest(tmp_path) == manifest


def test_streaming_memory_does_not_grow_with_the_images(tmp_path: Path) -> None:
    """Reading 40,000 entries a line at a time holds one; reading them whole holds them all."""
    entries = _entries(40_000)
    write_manifest(tmp_path, _manifest(entries))
    del entries

    def peak(read) -> float:
        tracemalloc.start()
        try:
            read()
            return tracemalloc.get_traced_memory()[1] / 1e6
        finally:
            tracemalloc.stop()

    streamed = peak(
        lambda: sum(1 for _ in iter_images(tmp_path)) + len(read_head(tmp_path).classes)
    )
    whole = peak(lambda: read_manifest(tmp_path))
    assert streamed < 2.0, streamed  # MB: a line and an entry at a time
    assert whole > 20 * streamed, (whole, streamed)


def test_a_failed_write_leaves_nothing_and_a_rewritten_result_is_refused(tmp_path: Path) -> None:
    entries = _entries(4)
    _with_files(tmp_path, entries)
    with pytest.raises(RuntimeError), ManifestWriter(tmp_path) as writer:
        writer.add(entries[0])
        raise RuntimeError("killed part way")
    assert not (tmp_path / MANIFEST).exists()
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]

    with ManifestWriter(tmp_path) as writer:
        for entry in entries:
            writer.add(entry)
        first = writer.finish(_manifest(entries).head())
    with ManifestWriter(tmp_path) as writer:
        writer.add(entries[0])
        second = writer.finish(_manifest(entries[:1]).head())
    assert second.images == entries[:1]
    with pytest.raises(InvalidImageDirectoryError, match="written again"):
        first.images  # noqa: B018 (the attribute read is the point)


def test_the_content_digest_streams_and_follows_the_files(tmp_path: Path) -> None:
    entries = _entries(4)
    write_manifest(_with_files(tmp_path, entries), _manifest(entries))
    digest = content_digest(tmp_path)
    assert digest is not None and content_digest(tmp_path) == digest
    (tmp_path / entries[1].path).write_bytes(b"edited")  # another size: edited in place
    assert content_digest(tmp_path) is None


def test_a_class_left_out_of_a_conversion_shifts_the_ids_after_it(tmp_path: Path) -> None:
    """Convert writes each entry as its file is checked, with the ids of every class named;
    a class whose every image is refused is dropped at the end and the lines relabeled."""
    from PIL import Image

    from tasks.data.convert import convert

    for folder in "abc":
        (tmp_path / "src" / folder).mkdir(parents=True)
    (tmp_path / "src" / "a" / "broken.png").write_bytes(b"not an image")
    for folder in "bc":
        Image.new("RGB", (8, 8), "red" if folder == "b" else "blue").save(
            tmp_path / "src" / folder / "1.png"
        )
    manifest = convert(tmp_path / "src", tmp_path / "out")

    assert manifest.classes == ["b", "c"] and manifest.counts == {"b": 1, "c": 1}
    assert {e.path: e.label for e in read_manifest(tmp_path / "out").images} == {
        "b/1.png": 0,
        "c/1.png": 1,
    }
    assert [s.path for s in manifest.skipped] == ["a/", "a/broken.png"]


def test_a_shard_lists_only_its_slice_of_an_image_directory(tmp_path: Path) -> None:
    """Score's shards of a big input each keep their own images, not the whole listing."""
    from tasks.inference.score.images import list_images, list_slice

    entries = _entries(10)
    write_manifest(_with_files(tmp_path / "images", entries), _manifest(entries))
    (tmp_path / "raw" / "x").mkdir(parents=True)
    for name in ("b.png", "a.png", "c.jpg"):
        (tmp_path / "raw" / "x" / name).write_bytes(b"abc")

    for folder in (tmp_path / "images", tmp_path / "raw"):
        whole, labeled = list_images(folder)
        refs, sliced_labeled, first, total = list_slice(folder, lambda n: (n // 3, 2 * n // 3))
        assert (first, total, sliced_labeled) == (len(whole) // 3, len(whole), labeled)
        assert refs == whole[first : 2 * total // 3] and refs
    assert [r.category for r in list_images(tmp_path / "images")[0][:2]] == ["a", "b"]
