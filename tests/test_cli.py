"""The command line, run as a user runs it: a real process, real exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

COMMANDS = ["sample", "convert", "split", "version", "model", "train", "export", "register",
            "score", "evaluate", "run"]  # fmt: skip


def imageops(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_help_lists_every_step(tmp_path: Path) -> None:
    result = imageops("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for command in COMMANDS:
        assert command in result.stdout


@pytest.mark.parametrize("command", ["train", "run", "score", "split"])
def test_every_option_is_explained(tmp_path: Path, command: str) -> None:
    result = imageops(command, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    options = [line for line in result.stdout.splitlines() if line.strip().startswith("│ --")]
    assert options, result.stdout
    for line in options:
        if "--help" in line:
            continue
        # an option line carries text beyond its name and type
        assert len(line.split()) > 4, line


def test_sample_then_convert_then_split(tmp_path: Path, project) -> None:
    result = imageops("sample", "digits", "raw", "--size", "12", "--per-class", "5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    raw = tmp_path / "raw"
    assert sorted(p.name for p in raw.iterdir()) == [str(d) for d in range(10)]
    result = imageops("convert", "raw", "images", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "50 images, 10 classes" in result.stdout
    result = imageops("split", "images", "a", "b", "--fraction", "0.6", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "a: 30 images; b: 20 images" in result.stdout


def test_bad_input_gets_a_message_not_a_traceback(tmp_path: Path) -> None:
    result = imageops("train", "nowhere", "t", "v", "out", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "error:" in result.stderr and "what to do:" in result.stderr
    result = imageops("split", "nowhere", "a", "b", "--fraction", "1.5", cwd=tmp_path)
    assert result.returncode == 2
    assert "fraction" in result.stderr and "Traceback" not in result.stderr
