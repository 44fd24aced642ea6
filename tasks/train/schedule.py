"""Learning-rate schedules, per step: linear warm-up, then the Azure design's polynomial decay
to 0 (``poly``), or half a cosine to 0 (``cosine``, the modern recipe's).

Per optimizer step rather than per epoch, so a short run (Azure's default is 5 epochs) still
decays smoothly. :func:`lr_factor` is a pure function (tested on its own); :func:`build_scheduler`
wraps it in a LambdaLR, whose state is plain numbers and so checkpoints with ``weights_only``.
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from tasks.train.recipes import Schedule

# 1.0 is a straight line to 0; 0.9 (the usual "poly" schedule) keeps the rate a little higher
# for longer, which matters in short runs where most steps are in the decay.
POWER = 0.9


STEP_GAMMA = 0.1  # step: the rate falls tenfold at each third of the decay (torchvision's 30/60/90)
ONECYCLE_RISE = 0.3  # onecycle: share of the steps spent rising (torch's OneCycleLR pct_start)
ONECYCLE_START = 1 / 25  # ... from this share of the rate (div_factor 25)
ONECYCLE_END = ONECYCLE_START / 1e4  # ... down to this (final_div_factor 1e4)


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    power: float = POWER,
    schedule: Schedule = "poly",
) -> float:
    """Multiplier of the base learning rate for optimizer step ``step`` (0-based).

    Warm-up rises linearly from ``1/warmup_steps`` (never 0: a step at rate 0 is wasted) to 1 at
    step ``warmup_steps``; then ``(1 - progress) ** power`` (poly) or ``(1 + cos(pi progress)) /
    2`` (cosine) falls towards 0 at ``total_steps``, so the last step still moves the weights a
    little, or ``0.1 ** (thirds passed)`` (step). ``onecycle`` is torch's OneCycleLR (cosine
    phases) and has its own rise, over the first 30% of the steps: it takes no warm-up.
    """
    if schedule == "onecycle":
        return _one_cycle(step, total_steps)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = total_steps - warmup_steps
    if decay_steps <= 0:  # warm-up covers the whole run: nothing left to decay over
        return 1.0
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "step":
        return STEP_GAMMA ** min(2, int(progress * 3))
    return (1.0 - progress) ** power


def _one_cycle(step: int, total_steps: int) -> float:
    """torch's OneCycleLR as a factor: half a cosine up from 1/25 to 1 over the first 30% of the
    steps, then half a cosine down to 1/250,000."""
    rise = max(1.0, ONECYCLE_RISE * total_steps - 1)
    if step <= rise:
        low, high, progress = ONECYCLE_START, 1.0, step / rise
    else:
        low, high = 1.0, ONECYCLE_END
        progress = min(1.0, (step - rise) / max(1.0, total_steps - 1 - rise))
    return high + (low - high) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: Optimizer,
    *,
    steps_per_epoch: int,
    epochs: int,
    warmup_epochs: int,
    power: float = POWER,
    schedule: Schedule = "poly",
    head_only_epochs: int = 0,
) -> LambdaLR:
    """A LambdaLR stepping :func:`lr_factor`; call ``scheduler.step()`` after every batch.

    With ``head_only_epochs``, the optimizer's groups marked ``backbone``
    (:func:`tasks.train.build.build_optimizer`) stay at rate 0 for those epochs' steps: only the
    new head learns, then the whole network follows the schedule. Freezing by rate keeps every
    parameter in DDP's gradient reduction (a parameter without gradients stalls it); the backbone's
    normalisation statistics still follow the data.
    """
    warmup_steps = warmup_epochs * steps_per_epoch
    total_steps = epochs * steps_per_epoch

    # A closure (not a partial or a callable object): LambdaLR then leaves it out of its
    # state_dict, which stays plain numbers.
    def factor(step: int) -> float:
        return lr_factor(
            step,
            warmup_steps=warmup_steps,
            total_steps=total_steps,
            power=power,
            schedule=schedule,
        )

    head_only_steps = head_only_epochs * steps_per_epoch

    def backbone_factor(step: int) -> float:  # frozen while the head learns alone
        return 0.0 if step < head_only_steps else factor(step)

    if not head_only_steps:
        return LambdaLR(optimizer, factor)
    lambdas = [backbone_factor if g.get("backbone") else factor for g in optimizer.param_groups]
    return LambdaLR(optimizer, lambdas)
