"""The command line, run as a user runs it: a real process, real exit codes."""

from __future__ import annotations

import inspect
import itertools
import json
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from projects import imageops
from rich.text import Text

from app.cli import app
from models.untrained import resnet, write_untrained
from tasks.data.convert import convert
from tasks.data.imagedir import read_manifest
from tasks.shared.settings import Settings

COMMANDS = ["sample", "convert", "split", "transform", "version", "model", "train", "tune",
            "export", "quantize", "register", "promote", "score", "evaluate", "serve",
            "run", "cluster", "gc"]  # fmt: skip


def test_help_lists_every_step(tmp_path: Path) -> None:
    result = imageops("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for command in COMMANDS:
        assert command in result.stdout


HELP_CHECKED = ["train", "run", "score", "split", "transform init", "transform apply",
                "promote", "evaluate", "quantize", "serve scoring", "serve webhook",
                "register-webhook", "tune", "cluster manifest", "team server",
                "team join", "gc"]  # fmt: skip


@pytest.mark.parametrize("command", HELP_CHECKED)
def test_every_option_is_explained(tmp_path: Path, command: str) -> None:
    result = imageops(*command.split(), "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    options = [line for line in result.stdout.splitlines() if line.strip().startswith("│ --")]
    assert options, result.stdout
    for line in options:
        if "--help" in line:
            continue
        # an option line carries text beyond its name and type
        assert len(line.split()) > 4, line


NARROW = 80  # a terminal's width when no one widened it
MIN_DESCRIPTION = 40


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every command and sub-command under ``command``, with the words that name it."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def _wrapped_by_the_renderer(lines: list[str], width: int) -> list[str]:
    """The breaks in ``lines`` (one text, wrapped to ``width``) that the width did not force: a
    line the next line's first word would still have fitted on was broken by hand."""
    return [
        f"{line.strip()!r} / {following.split()[0]!r}"
        for line, following in itertools.pairwise(lines)
        if following.strip() and len(line.rstrip()) + 1 + len(following.split()[0]) <= width
    ]


def _entry_problems(where: str, block: list[str], start: int, words: list[str]) -> list[str]:
    """What is wrong with one entry of a panel (an option, an argument, a command): ``block`` its
    lines, ``start`` where its name ends on the first, ``words`` its description's first words.

    Its description must be whole, in a column at least MIN_DESCRIPTION wide, wrapped only by
    the renderer."""
    word = re.compile(rf"(?<!\S){re.escape(words[0])}(?!\S)")
    # on the entry's first line, after its name; else on a line below it (two lines an entry)
    found = [(i, word.search(line, start if i == 0 else 0)) for i, line in enumerate(block)]
    first = next(((i, m.start()) for i, m in found if m), None)
    if first is None:
        return [f"{where}: description not found whole ({words[0]!r})"]
    row, column = first
    border = block[row].rindex("│")
    width = border - 1 - column  # the panel's padding before its right border
    lines = [line[column:border] for line in block[row:]]
    problems = []
    if width < MIN_DESCRIPTION:
        problems.append(f"{where}: description {width} columns wide")
    if " ".join(lines).split()[: len(words)] != words:
        problems.append(f"{where}: description cut or out of its column: {lines}")
    problems += [f"{where}: broken by hand: {b}" for b in _wrapped_by_the_renderer(lines, width)]
    return problems


def _first_paragraph(help_text: str) -> str:
    return inspect.cleandoc(help_text).split("\n\n")[0]


def _help_problems(where: str, command: Any, shown: str) -> list[str]:
    """What makes ``shown``, ``command``'s help at NARROW columns, hard to read."""
    problems = [
        f"{where}: line {len(line)} wide: {line!r}"
        for line in shown.splitlines()
        if len(line) > NARROW
    ]
    lines = shown.splitlines()
    # The command's paragraphs: between the usage (ended by a blank line) and the first panel.
    top = list(itertools.takewhile(lambda line: not line.startswith("╭"), lines))
    usage = next(i for i, line in enumerate(top) if "Usage:" in line)
    text = top[next(i for i in range(usage, len(top)) if not top[i].strip()) :]
    for _blank, paragraph in itertools.groupby(text, key=lambda line: not line.strip()):
        problems += [
            f"{where}: paragraph broken by hand: {b}"
            for b in _wrapped_by_the_renderer([line[1:] for line in paragraph], NARROW - 2)
        ]
    # Its entries: options and arguments (their names whole), sub-commands.
    params = [p for p in command.get_params(typer.Context(command)) if not p.hidden]
    names = {p: p.opts[0] if p.opts[0].startswith("-") else p.metavar or p.name for p in params}
    for param in params:
        problems += [
            f"{where}: {name} not shown whole"
            for name in param.opts + param.secondary_opts
            if name.startswith("-")
            and not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", shown)
        ]
    entries = {names[p]: Text.from_markup(p.help or "").plain.split() for p in params if p.help}
    entries |= {
        name: Text.from_markup(_first_paragraph(sub.short_help or sub.help or "")).plain.split()
        for name, sub in getattr(command, "commands", {}).items()
        if not sub.hidden
    }
    heads = {
        name: re.compile(rf"^│ (?:\*\s{{1,4}}|\s{{0,3}}){re.escape(name)}(?![\w-])")
        for name in entries
    }
    for name, words in entries.items():
        row = next((i for i, line in enumerate(lines) if heads[name].match(line)), None)
        if row is None:
            problems.append(f"{where}: {name} has no entry")
            continue
        end = next(
            i
            for i in range(row + 1, len(lines))
            if lines[i].startswith("╰") or any(h.match(lines[i]) for h in heads.values())
        )
        problems += _entry_problems(
            f"{where} {name}", lines[row:end], heads[name].match(lines[row]).end(), words
        )
    return problems


def test_every_help_reads_well_at_80_columns(
    project: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every command's and sub-command's --help on an 80-column terminal: every option's name
    whole, descriptions in a column at least 40 wide, paragraphs wrapped by the renderer (the
    source's own line breaks are not the terminal's), no line wider than the terminal."""
    monkeypatch.setenv("COLUMNS", str(NARROW))
    root = typer.main.get_command(app)  # once: building it costs more than printing a help
    problems = []
    for path, command in _commands(root):
        assert root.main([*path, "--help"], prog_name="imageops", standalone_mode=False) == 0
        shown = Text.from_ansi(capsys.readouterr().out).plain  # colours, where the CI forces them
        problems += _help_problems(" ".join(("imageops", *path)), command, shown)
    assert not problems, "\n".join(problems)


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
    assert "error: InvalidModelDirectoryError: nowhere " in result.stderr  # the Azure design's name
    assert "what to do:" in result.stderr
    result = imageops("split", "nowhere", "a", "b", "--fraction", "1.5", cwd=tmp_path)
    assert result.returncode == 2
    assert "fraction" in result.stderr and "Traceback" not in result.stderr
    result = imageops("promote", "nowhere", cwd=tmp_path)
    assert result.returncode == 2
    assert "is not an ImageDirectory" in result.stderr and "what to do:" in result.stderr


def test_transform_init_then_apply(tmp_path: Path, digits_split: tuple[Path, Path]) -> None:
    result = imageops(
        "transform", "init", "t", "--resize-size", "20", "--center-crop-size", "12",
        "--no-random-horizontal-flip", "--random-rotation", "--random-rotation-degrees", "15",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "the network sees 12x12 images" in result.stdout
    spec = json.loads((tmp_path / "t" / "transform.json").read_text())["transform"]
    assert (spec["resize_size"], spec["random_rotation_degrees"]) == (20, 15)
    assert spec["center_crop_size"] == 12 and not spec["random_horizontal_flip"]
    assert spec["random_crop_size"] == 224  # an option not given keeps the Azure design's default

    val = digits_split[1]
    result = imageops(
        "transform", "apply", "t", str(val), "out", "--mode", "training", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert f"out: {len(read_manifest(val).images)} images (12x12), 0 skipped" in result.stdout

    result = imageops("transform", "init", "bad", "--random-affine-degrees", "200", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "random_affine_degrees = 200, expected an integer from 0 to 180" in result.stderr


def _seed_error_inputs(
    error: str, tmp_path: Path, digits_raw: Path, digits_split: tuple[Path, Path]
) -> list[str]:
    """The command that meets ``error``, one of the Azure design's errors, and its inputs."""
    train, val = (str(p) for p in digits_split)
    untrained = str(write_untrained(resnet("resnet18", pretrained=False), tmp_path / "untrained"))
    if error == "InvalidModelDirectoryError":  # a folder that is not a model directory
        (tmp_path / "x").mkdir()
        return ["train", "x", train, val, "out", "--epochs", "1"]
    if error == "NotLabeledDatasetError":  # one class folder alone converts to a flat folder
        convert(digits_raw / "0", tmp_path / "unlabeled")
        return ["train", untrained, "unlabeled", val, "out", "--epochs", "1"]
    if error == "InvalidDatasetError":  # validation without the training set's class 2
        for digit in ("0", "1"):
            shutil.copytree(digits_raw / digit, tmp_path / "raw01" / digit)
        convert(tmp_path / "raw01", tmp_path / "val01")
        return ["train", untrained, train, "val01", "out", "--epochs", "1"]
    assert error == "InvalidTransformationDirectoryError"  # a folder without transform.json
    (tmp_path / "transform").mkdir()
    return ["transform", "apply", "transform", val, "out"]


def _main(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    """Run ``imageops argv`` through the console script's entry, in this process (the imports
    of torch and MLflow are then paid once, not per command); its exit status."""
    from app.cli import main

    monkeypatch.setattr(sys, "argv", ["imageops", *argv])
    try:
        main()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


@pytest.mark.parametrize(
    "error",
    [
        "InvalidModelDirectoryError",
        "NotLabeledDatasetError",
        "InvalidDatasetError",
        "InvalidTransformationDirectoryError",
    ],
)
def test_the_seed_errors_are_named_on_the_error_line(
    error: str,
    tmp_path: Path,
    project,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    digits_raw: Path,
    digits_split: tuple[Path, Path],
) -> None:
    argv = _seed_error_inputs(error, tmp_path, digits_raw, digits_split)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()

    code = _main(argv, monkeypatch)

    printed = capsys.readouterr()
    shown = f"exit {code}\n{printed.out}\n{printed.err}"
    assert code == 2, shown
    assert "Traceback" not in printed.out + printed.err, shown
    lines = printed.err.splitlines()
    error_lines = [line for line in lines if line.startswith("error:")]
    assert len(error_lines) == 1 and error_lines[0].startswith(f"error: {error}: "), shown
    assert any(line.startswith("what to do: ") and line[12:].strip() for line in lines), shown
    assert not (tmp_path / "out").exists(), shown


def test_score_on_the_team_cluster_outside_a_team_is_refused_naming_the_setting(
    tmp_path: Path,
    project,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 45: `imageops score ... --cluster team` takes the team's cluster from the join
    file's IMAGEOPS_RAY_ADDRESS; on a machine in no team, one error line says so, before any
    model or image is looked at, and nothing is written."""
    monkeypatch.delenv("IMAGEOPS_RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()

    code = _main(["score", "models:/nowhere/1", "nowhere", "out.csv", "--cluster", "team"],
                 monkeypatch)  # fmt: skip

    printed = capsys.readouterr()
    assert code == 2, printed
    assert "error: ClusterUnavailableError: --cluster team: this machine is in no team" in (
        printed.err
    ), printed
    assert "what to do: Source the team's join file" in printed.err
    assert not (tmp_path / "out.csv").exists()
