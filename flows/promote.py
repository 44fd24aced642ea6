"""The promote flow: the registered challenger against the champion, on held-out data.

Run after training (the pipeline registers each new model as ``challenger``), by hand from the
Prefect UI, or on a schedule. Moving ``champion`` starts batch scoring through the alias event
(:mod:`tasks.promotion_events`).
"""

from __future__ import annotations

from prefect import flow

from tasks.promote import CHALLENGER, Promotion, promote_task
from tasks.settings import get_settings


@flow(name="imageops-promote", log_prints=True)
def promote_flow(
    holdout: str | None = None,
    candidate: str = CHALLENGER,
    metric: str = "accuracy",
    margin: float = 0.0,
) -> Promotion:
    """Promote ``candidate`` (alias or version) to champion if it beats it by ``margin``.

    ``holdout``: a labeled ImageDirectory neither model trained on (default: the pipeline's
    validation set, data/val).
    """
    settings = get_settings()
    data = settings.project_root / holdout if holdout else settings.data_path / "val"
    return promote_task(data, candidate=candidate, metric=metric, margin=margin)
