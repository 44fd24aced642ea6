"""`auto` precision is decided once per run: a resume keeps it, whatever machine it lands on."""

from __future__ import annotations

from pathlib import Path

import pytest

import tasks.train.precision as precision
from models.untrained import resnet, write_untrained
from tasks.shared.settings import Settings
from tasks.train.params import TrainParams
from tasks.train.request import CONFIG, Request, TrainRequest, check_request

LARGE = {"resize_size": 64, "center_crop_size": 64}  # at 64 px and up, "auto" may be bf16 on CPU


def _request(tmp_path: Path, project: Settings, digits_split: tuple[Path, Path]) -> Request:
    model = write_untrained(resnet("resnet18", pretrained=False), tmp_path / "untrained")
    train, val = digits_split
    params = TrainParams(epochs=1, batch_size=8, device="cpu", precision="auto")
    request = TrainRequest(
        model=model, train_data=train, val_data=val, out=tmp_path / "out", params=params,
        transform=LARGE,
    )  # fmt: skip
    return check_request(request, project)


def test_a_resumed_run_keeps_the_precision_auto_chose_and_does_not_decide_again(
    tmp_path: Path,
    project: Settings,
    digits_split: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    looked: list[str | None] = []

    def cpu_with(feature: str | None) -> None:
        """The machine the launcher runs on: its native bf16 instructions, if any."""

        def flags() -> str | None:
            looked.append(feature)
            return feature

        monkeypatch.setattr(precision, "cpu_bf16_feature", flags)
        monkeypatch.setattr(precision, "cpu_bf16_runs", lambda: True)

    cpu_with("avx512_bf16")  # the run starts on a CPU with native bf16
    request = _request(tmp_path, project, digits_split)
    assert looked == []  # checking the request decides nothing yet
    run_dir = project.runs_dir / "run-1"
    started = request.bind("run-1", run_dir)
    assert started.precision == "bf16" and looked == ["avx512_bf16"]
    run_dir.mkdir(parents=True)
    started.save(run_dir / CONFIG)

    cpu_with(None)  # the retry lands on a machine without it
    retry = _request(tmp_path, project, digits_split)
    assert retry.config.job_key() == started.job_key()  # so the retry finds the same run
    resumed = retry.bind("run-1", run_dir)
    assert resumed.precision == "bf16" and looked == ["avx512_bf16"]  # recorded, not decided
    assert resumed.digest() == started.digest()  # the checkpoint's job: resumed, not refused
    why = precision.precision_reason("auto", "bf16", "cpu", 64)  # what its log will say
    assert why.startswith("chosen when the run started and kept; here auto would give fp32")

    fresh = retry.bind("run-2", project.runs_dir / "run-2")  # a new run decides for itself
    assert fresh.precision == "fp32" and looked == ["avx512_bf16", None, None]
