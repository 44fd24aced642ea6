"""`imageops run` on a source no classifier can learn from: refused before the flow starts.

One `error:` line naming the error, one `what to do:` line, no traceback, exit 2, and nothing
written: no data set folder, no outputs, no DVC files.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tasks.shared.settings import Settings


def _flat(raw: Path, dest: Path) -> Path:
    """The digits' images side by side, no class folders."""
    dest.mkdir(parents=True)
    for png in sorted(raw.rglob("*.png"))[:12]:
        shutil.copyfile(png, dest / f"{png.parent.name}-{png.name}")
    return dest


def _one_class(raw: Path, dest: Path) -> Path:
    shutil.copytree(raw / "0", dest / "0")
    return dest


def _flat_zip(raw: Path, dest: Path) -> Path:
    archive = dest.with_suffix(".zip")
    archive.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(archive, "w") as zf:
        for png in sorted(raw.rglob("*.png"))[:12]:
            zf.write(png, f"photos/{png.parent.name}-{png.name}")  # wrapped, but flat inside
    return archive


def _missing(raw: Path, dest: Path) -> Path:
    return dest


CASES: list[tuple[str, Callable[[Path, Path], Path], str]] = [
    ("flat-folder", _flat, "NotLabeledDatasetError"),
    ("one-class", _one_class, "InvalidDatasetError"),
    ("flat-zip", _flat_zip, "NotLabeledDatasetError"),
    ("missing", _missing, "NoUsableImagesError"),
]


def _run(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """``imageops run ...`` through the console entry, in this process (imports paid once)."""
    from app.cli import main

    monkeypatch.setattr(sys, "argv", ["imageops", "run", *argv])
    try:
        main()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


@pytest.mark.parametrize(("case", "make", "error"), CASES, ids=[c[0] for c in CASES])
def test_a_source_without_labels_is_refused_before_the_flow(
    project: Settings,
    digits_raw: Path,
    case: str,
    make: Callable,
    error: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = make(digits_raw, project.project_root / "incoming" / case)
    assert _run([str(source), "--dataset", "pets"], monkeypatch) == 2
    printed = capsys.readouterr()
    errors = [line for line in printed.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {error}: "), printed.err
    assert "what to do:" in printed.err
    assert len((printed.out + printed.err).splitlines()) <= 6  # not ~190 lines of a flow
    assert not (project.data_path / "pets").exists()  # no convert, split or DVC happened
    assert not (project.home_dir / "outputs").exists()
    # not even Prefect's temporary API was started
    assert not (project.home_dir / "prefect" / "temporary-api.log").exists()


def test_the_terminal_shows_no_traceback_and_the_refusal_is_quick(
    project: Settings, digits_raw: Path
) -> None:
    """The console script itself, as a user runs it."""
    source = _flat(digits_raw, project.project_root / "incoming" / "flat")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", "run", str(source)],
        cwd=project.project_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: NotLabeledDatasetError: "), result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert time.monotonic() - started < 60  # no flow, no Prefect API: imports only
