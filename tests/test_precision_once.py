"""`auto` precision is decided once per run: a resume keeps it, whatever the machine measures."""

from __future__ import annotations

from pathlib import Path

import pytest

import tasks.train.precision as precision
from models.untrained import resnet, write_untrained
from tasks.shared.settings import Settings
from tasks.train.params import TrainParams
from tasks.train.request import CONFIG, Request, TrainRequest, check_request

LARGE = {"resize_size": 64, "center_crop_size": 64}  # at 64 px and up, "auto" times bf16 on CPU


def _request(tmp_path: Path, project: Settings, digits_split: tuple[Path, Path]) -> Request:
    model = write_untrained(resnet("resnet18", pretrained=False), tmp_path / "untrained")
    train, val = digits_split
    params = TrainParams(epochs=1, batch_size=8, device="cpu", precision="auto")
    request = TrainRequest(
        model=model, train_data=train, val_data=val, out=tmp_path / "out", params=params,
        transform=LARGE,
    )  # fmt: skip
    return check_request(request, project)


def test_a_resumed_run_keeps_the_precision_auto_chose_and_does_not_measure_again(
    tmp_path: Path,
    project: Settings,
    digits_split: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timings: list[float] = []

    def measured(speedup: float) -> None:
        def timed(repeats: int = 5) -> float:
            timings.append(speedup)
            return speedup

        monkeypatch.setattr(precision, "cpu_bf16_speedup", timed)

    measured(1.5)  # bf16 ran faster when the run started
    request = _request(tmp_path, project, digits_split)
    assert timings == []  # checking the request decides nothing yet
    run_dir = project.runs_dir / "run-1"
    started = request.bind("run-1", run_dir)
    assert started.precision == "bf16" and timings == [1.5]
    run_dir.mkdir(parents=True)
    started.save(run_dir / CONFIG)

    measured(0.5)  # the retry lands on a busier machine, where bf16 would now look slower
    retry = _request(tmp_path, project, digits_split)
    assert retry.config.job_key() == started.job_key()  # so the retry finds the same run
    resumed = retry.bind("run-1", run_dir)
    assert resumed.precision == "bf16" and timings == [1.5]  # recorded, not measured again
    assert resumed.digest() == started.digest()  # the checkpoint's job: resumed, not refused

    fresh = retry.bind("run-2", project.runs_dir / "run-2")  # a new run decides for itself
    assert fresh.precision == "fp32" and timings == [1.5, 0.5]
