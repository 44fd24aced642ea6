"""What a worker decides after each epoch: the best epoch and early stopping."""

from __future__ import annotations

import pytest

from tasks.train.loop import TOP1, VAL_LOSS
from tasks.train.progress import Progress


def _run(epochs: list[tuple[float, float]], patience: int, total: int) -> Progress:
    """``epochs``: (val loss, top-1) of each epoch, recorded in order."""
    progress = Progress()
    for epoch, (loss, top1) in enumerate(epochs, start=1):
        progress.record(epoch, {VAL_LOSS: loss, TOP1: top1}, patience, total)
    return progress


def test_the_best_epoch_is_the_highest_top1_and_the_first_of_a_tie() -> None:
    progress = _run([(1.0, 0.5), (0.9, 0.7), (0.8, 0.7), (0.7, 0.6)], patience=9, total=4)
    assert (progress.best_epoch, progress.best_top1) == (2, 0.7)


def test_record_says_whether_the_epoch_is_the_new_best() -> None:
    progress = Progress()
    assert progress.record(1, {VAL_LOSS: 1.0, TOP1: 0.5}, 3, 5)
    assert not progress.record(2, {VAL_LOSS: 0.9, TOP1: 0.5}, 3, 5)


@pytest.mark.parametrize(
    ("losses", "patience", "total", "stopped"),
    [
        ([1.0, 1.1, 1.2], 2, 5, True),  # two epochs without a lower loss: stop
        ([1.0, 1.1, 0.9], 2, 5, False),  # a lower loss resets the count
        ([1.0, 1.1, 1.2], 2, 3, False),  # the last epoch is never an early stop
        ([1.0, 1.0], 1, 5, True),  # equal is not lower
    ],
)
def test_early_stop_after_patience_epochs_without_a_lower_validation_loss(
    losses: list[float], patience: int, total: int, stopped: bool
) -> None:
    progress = _run([(loss, 0.5) for loss in losses], patience, total)
    assert progress.stopped_early is stopped
