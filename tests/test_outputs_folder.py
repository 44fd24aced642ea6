"""The same request run again after a stop gets its unfinished outputs folder back (so its
training, whose identity includes that folder, resumes); a finished request or one running now
does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.shared.settings import Settings
from tasks.train.outputs_folder import outputs_folder


class Stopped(Exception):
    """A run that ended before its request finished."""


def _stopped(settings: Settings, fresh: str, request: str) -> Path:
    with pytest.raises(Stopped), outputs_folder(settings, fresh, request) as folder:
        folder.mkdir(parents=True)
        raise Stopped
    return folder


def test_an_unfinished_request_run_again_gets_its_folder_back(project: Settings) -> None:
    first = _stopped(project, "first", '{"epochs": 3}')
    with outputs_folder(project, "second", '{"epochs": 3}') as again:
        assert again == first
    with outputs_folder(project, "third", '{"epochs": 3}') as after_finishing:
        assert after_finishing == project.outputs_dir / "third"


def test_another_request_or_a_removed_folder_gets_a_new_one(project: Settings) -> None:
    first = _stopped(project, "first", '{"epochs": 3}')
    with outputs_folder(project, "other", '{"epochs": 4}') as other:
        assert other == project.outputs_dir / "other"
    first.rmdir()  # e.g. `imageops gc --yes`
    with outputs_folder(project, "new", '{"epochs": 3}') as again:
        assert again == project.outputs_dir / "new"


def test_the_same_request_running_now_is_not_joined(project: Settings) -> None:
    first = _stopped(project, "first", '{"epochs": 3}')
    with (
        outputs_folder(project, "running", '{"epochs": 3}') as running,
        outputs_folder(project, "alongside", '{"epochs": 3}') as alongside,
    ):
        assert running == first
        assert alongside == project.outputs_dir / "alongside"
