"""The learning-rate schedule: linear warm-up, then polynomial decay to 0, per step."""

from __future__ import annotations

import io
import itertools

import pytest
import torch

from tasks.train.schedule import build_scheduler, lr_factor


def test_warmup_rises_linearly_to_the_full_rate() -> None:
    factors = [lr_factor(s, warmup_steps=4, total_steps=10, power=1.0) for s in range(4)]
    assert factors == [0.25, 0.5, 0.75, 1.0]


def test_decay_after_warmup_is_polynomial_and_reaches_zero_at_the_end() -> None:
    # 4 warm-up steps, then 6 decay steps: progress p = (step - 4) / 6, factor (1 - p) ** 0.9.
    for step in range(4, 10):
        expected = (1 - (step - 4) / 6) ** 0.9
        assert lr_factor(step, warmup_steps=4, total_steps=10, power=0.9) == pytest.approx(expected)
    assert lr_factor(4, warmup_steps=4, total_steps=10) == 1.0
    assert lr_factor(10, warmup_steps=4, total_steps=10) == 0.0
    assert lr_factor(12, warmup_steps=4, total_steps=10) == 0.0  # never negative past the end


def test_without_warmup_the_first_step_uses_the_full_rate_and_the_last_is_not_zero() -> None:
    factors = [lr_factor(s, warmup_steps=0, total_steps=5, power=1.0) for s in range(5)]
    assert factors == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    assert all(a > b for a, b in itertools.pairwise(factors))


def test_warmup_longer_than_the_run_never_decays() -> None:
    assert lr_factor(1, warmup_steps=10, total_steps=5) == pytest.approx(0.2)
    assert lr_factor(12, warmup_steps=10, total_steps=5) == 1.0


def test_scheduler_steps_per_batch_and_checkpoints_as_plain_values() -> None:
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    scheduler = build_scheduler(optimizer, steps_per_epoch=2, epochs=3, warmup_epochs=1, power=1.0)
    rates = []
    for _ in range(6):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([0.05, 0.1, 0.1, 0.075, 0.05, 0.025])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0)

    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # no pickled function in it
    resumed = build_scheduler(
        torch.optim.SGD([weight], lr=0.1), steps_per_epoch=2, epochs=3, warmup_epochs=1, power=1.0
    )
    resumed.load_state_dict(state)
    assert resumed.last_epoch == 6
