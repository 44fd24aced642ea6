"""`imageops run` on a source no classifier can learn from, or with a training request the
source cannot fill (a batch larger than its training split would be, absurd epochs): refused
before the flow starts.

One `error:` line naming the error, one `what to do:` line, no traceback, exit 2, and nothing
written: no data set folder (no convert, split or DVC), no outputs.
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
import yaml

from flows.config import PipelineConfig
from tasks.data.imagedir import read_manifest
from tasks.shared.settings import Settings
from tasks.train.params import MAX_BATCH_SIZE, MAX_EPOCHS


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
    _assert_refused(capsys.readouterr(), error, project)


def _assert_refused(printed: pytest.CaptureResult[str], error: str, project: Settings) -> str:
    """One error line naming ``error``, a hint, and nothing started: the error line."""
    errors = [line for line in printed.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {error}: "), printed.err
    assert "what to do:" in printed.err
    assert len((printed.out + printed.err).splitlines()) <= 6  # not ~190 lines of a flow
    assert not (project.data_path / "pets").exists()  # no convert, split or DVC happened
    assert not (project.home_dir / "outputs").exists()
    # not even Prefect's temporary API was started
    assert not (project.home_dir / "prefect" / "temporary-api.log").exists()
    return errors[0]


def _zip(raw: Path, dest: Path) -> Path:
    archive = dest.with_suffix(".zip")
    archive.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(archive, "w") as zf:
        for png in sorted(raw.rglob("*.png")):
            zf.write(png, f"digits/{png.relative_to(raw).as_posix()}")
    return archive


def _csv(raw: Path, dest: Path) -> Path:
    """A CSV label file naming every image, beside the images."""
    folder = shutil.copytree(raw, dest)
    rows = [
        f"{png.relative_to(folder).as_posix()},{png.parent.name}" for png in folder.rglob("*.png")
    ]
    (folder / "labels.csv").write_text("\n".join(["path,label", *sorted(rows)]) + "\n")
    return folder / "labels.csv"


def _config(project: Settings, **values: object) -> str:
    """A params.yaml-shaped file: the defaults with ``values`` for whole sections."""
    path = project.project_root / "request.yaml"
    path.write_text(yaml.safe_dump(PipelineConfig().model_dump(mode="json") | values))
    return str(path)


def _folder(raw: Path, dest: Path) -> Path:
    return raw  # as it is: nothing writes into a source


@pytest.mark.parametrize("make", [_folder, _zip, _csv], ids=["folder", "zip", "csv"])
def test_a_batch_its_training_split_cannot_fill_is_refused_before_convert(
    project: Settings,
    digits_raw: Path,
    digits_split: tuple[Path, Path],
    make: Callable,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The split is not made yet: its size is bounded by split's share of each class's files,
    counted by name, and the bound is exactly what split then makes (digits_split, 0.8)."""
    source = make(digits_raw, project.project_root / "incoming" / "digits")
    images = len(read_manifest(digits_split[0]).images)
    split = {"fraction": 0.8, "seed": 1}
    train = PipelineConfig().train.model_dump() | {"batch_size": images + 1}
    config = _config(project, split=split, train=train)
    assert _run([str(source), "--dataset", "pets", "--config", config], monkeypatch) == 2
    error = _assert_refused(capsys.readouterr(), "InvalidParameterError", project)
    assert f"batch_size = {images + 1} is larger than the training set (at most {images} " in error
    # A batch of the whole training split passes the check (the run itself is the pipeline's).
    fits = train | {"batch_size": images}
    PipelineConfig(source=str(source), dataset="pets", split=split, train=fits).check_sources(
        project
    )


@pytest.mark.parametrize(
    ("options", "train", "says"),
    [
        (["--epochs", "1000000000000"], {},
         f"train.epochs: Input should be less than or equal to {MAX_EPOCHS} (got 1000000000000)"),
        (["--epochs", "0"], {}, "train.epochs: Input should be greater than 0 (got 0)"),
        ([], {"epochs": 10**12},
         f"train.epochs: Input should be less than or equal to {MAX_EPOCHS}"),
        ([], {"batch_size": 10**9},
         f"train.batch_size: Input should be less than or equal to {MAX_BATCH_SIZE}"),
        (["--nproc-per-node", "81"], {}, "81 processes (nodes x nproc_per_node) need more "
         "training images than the training set has (at most 81 images"),
    ],
    ids=["epochs-option", "zero-epochs-option", "epochs-config", "batch-config", "processes"],
)  # fmt: skip
def test_absurd_epochs_batches_and_processes_are_refused_before_convert(
    project: Settings,
    digits_raw: Path,
    options: list[str],
    train: dict,
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = _config(project, train=PipelineConfig().train.model_dump() | train)
    argv = [str(digits_raw), "--dataset", "pets", "--config", config, *options]
    assert _run(argv, monkeypatch) == 2
    error = _assert_refused(capsys.readouterr(), "InvalidParameterError", project)
    assert says in error


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
