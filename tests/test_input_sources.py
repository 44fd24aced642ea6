"""Input sources are a registry: a new format is one class and one registry line (issue 20.4)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app.cli import app
from tasks.data.convert import INPUT_SOURCES, LabelFileSource, convert, register_source
from tasks.data.imagedir import read_manifest
from tasks.data.labelfiles import Row
from tasks.shared.errors import InvalidLabelFileError, NoUsableImagesError
from tasks.shared.settings import Settings


class _JsonLines(LabelFileSource):
    """A toy format: one JSON object per line, {"path": ..., "label": ...}."""

    name = "jsonl"
    described = 'a JSON-lines manifest (.jsonl, {"path", "label"} per line)'
    suffixes = (".jsonl",)

    def rows(self, path: Path, text: str) -> tuple[list[Row], list[str] | None]:
        rows = []
        for n, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InvalidLabelFileError(f"{path}, line {n}: {exc.msg}.") from exc
                rows.append(Row(entry["path"], entry.get("label"), f"line {n}"))
        return rows, None


@pytest.fixture
def json_lines() -> Iterator[_JsonLines]:
    source = register_source(_JsonLines())
    yield source
    INPUT_SOURCES.remove(source)


@pytest.fixture
def manifest_file(digits_raw: Path, tmp_path: Path) -> Path:
    """Four scans of two digits in one flat folder, and a .jsonl naming their labels."""
    base = tmp_path / "photos"
    base.mkdir()
    lines = []
    for digit in ("0", "1"):
        for i, scan in enumerate(sorted((digits_raw / digit).glob("*.png"))[:2]):
            shutil.copyfile(scan, base / f"{digit}-{i}.png")
            lines.append(json.dumps({"path": f"{digit}-{i}.png", "label": f"digit{digit}"}))
    path = base / "labels.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_an_input_nothing_reads_is_refused_naming_the_sources(
    manifest_file: Path, tmp_path: Path
) -> None:
    with pytest.raises(NoUsableImagesError) as refused:
        convert(manifest_file, tmp_path / "out")
    assert "folder, archive, csv, coco" in str(refused.value)
    assert "a COCO classification label file (.json)" in refused.value.hint
    assert not (tmp_path / "out").exists()


def test_a_registered_source_converts_through_the_cli(
    json_lines: _JsonLines, manifest_file: Path, tmp_path: Path, project: Settings
) -> None:
    # `project`: the command exports its settings to os.environ; monkeypatch undoes that.
    result = CliRunner().invoke(app, ["convert", str(manifest_file), str(tmp_path / "out")])

    assert result.exit_code == 0, result.output
    manifest = read_manifest(tmp_path / "out")
    assert manifest.classes == ["digit0", "digit1"]
    assert sorted(e.path for e in manifest.images) == [
        "digit0/0-0.png",
        "digit0/0-1.png",
        "digit1/1-0.png",
        "digit1/1-1.png",
    ]


def test_a_registered_source_is_named_in_the_hints(json_lines: _JsonLines, tmp_path: Path) -> None:
    odd = tmp_path / "labels.txt"
    odd.write_text("nothing imageops reads\n")
    with pytest.raises(NoUsableImagesError) as refused:
        convert(odd, tmp_path / "out")
    assert "jsonl" in str(refused.value)
    assert "a JSON-lines manifest" in refused.value.hint


def test_a_source_name_is_registered_once(json_lines: _JsonLines) -> None:
    with pytest.raises(ValueError, match="registered already"):
        register_source(_JsonLines())
