"""The promote flow: the registered challenger against the champion, on held-out data.

Run after training (the pipeline registers each new model as ``challenger``), by hand from the
Prefect UI, or on a schedule. Moving ``champion`` starts batch scoring through the alias event
(:mod:`tasks.registry.promotion_events`).
"""

from __future__ import annotations

from typing import Annotated

from tasks.registry.promote import CHALLENGER, Promotion, promote_task
from tasks.shared.flow_parameters import checked_flow
from tasks.shared.forms import form_field
from tasks.shared.settings import get_settings
from tasks.shared.step import name_flow_run


@checked_flow(name="imageops-promote", log_prints=True)
def promote_flow(
    holdout: Annotated[
        str | None,
        form_field(
            title="Holdout images",
            description="Labeled ImageDirectory neither model trained on, relative to the "
            "project root. Empty: the demo pipeline's validation set (data/digits/val).",
        ),
    ] = None,
    candidate: Annotated[
        str,
        form_field(
            title="Candidate",
            description="Alias (e.g. challenger) or version number of the model to promote.",
            min_length=1,
        ),
    ] = CHALLENGER,
    metric: Annotated[
        str,
        form_field(
            title="Metric",
            description="Evaluate Model metric compared (higher is better): accuracy, "
            "top5_accuracy, precision/recall/f1 _macro or _weighted.",
        ),
    ] = "accuracy",
    margin: Annotated[
        float,
        form_field(
            title="Margin",
            description="How much more than the champion's the candidate's metric must be.",
            ge=0.0,
            lt=1.0,
        ),
    ] = 0.0,
) -> Promotion:
    """Promote ``candidate`` (alias or version) to champion if it beats it by ``margin``."""
    name_flow_run(f"promote-{candidate}")
    settings = get_settings()
    data = settings.project_root / holdout if holdout else settings.data_path / "digits" / "val"
    return promote_task(data, candidate=candidate, metric=metric, margin=margin)
