"""Registry commands: register a model version, promote it, MLflow's registry webhook."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from app.cli.root import (
    _data_argument,
    app,
    out,
)
from tasks.shared.settings import Settings, get_settings

# The registered model's name: one option for `register` and `promote`.
ModelName = Annotated[
    str | None,
    typer.Option(
        help="Registered model name. Default: IMAGEOPS_REGISTERED_MODEL_NAME, else "
        "imageops-classifier."
    ),
]


@app.command()
def register(
    model_dir: Annotated[Path, typer.Argument(help="Exported ModelDirectory.")],
    alias: Annotated[str | None, typer.Option(help="Alias to point at the new version.")] = None,
    name: ModelName = None,
    val_data: Annotated[
        str | None,
        typer.Option(
            help="Labeled validation ImageDirectory (or a version of one, NAME@VERSION): the "
            "ONNX model is scored on it and those figures are the version's, as `imageops "
            "evaluate` of it gives them. Without it, the version shows training's own figure, "
            "labelled so."
        ),
    ] = None,
) -> None:
    """Register the model's ONNX export as a new MLflow model version."""
    from tasks.registry.register import register as run

    validation = None if val_data is None else _data_argument(val_data, "validation data").path
    registered = run(model_dir, alias=alias, settings=_with_model_name(name), validation=validation)
    out.print(f"registered {registered.name} version {registered.version}")


def _with_model_name(name: str | None) -> Settings:
    """The settings, with the registered model name a command was given."""
    settings = get_settings()
    return settings.model_copy(update={"registered_model_name": name}) if name else settings


@app.command()
def promote(
    holdout: Annotated[
        Path,
        typer.Argument(
            help="Labeled ImageDirectory neither model trained on (e.g. data/digits/val)."
        ),
    ],
    candidate: Annotated[
        str, typer.Option(help="Alias or version number of the model to promote.")
    ] = "challenger",
    metric: Annotated[
        str,
        typer.Option(
            help="Evaluate Model metric that decides (higher is better): accuracy, "
            "top5_accuracy, precision/recall/f1 with _macro or _weighted."
        ),
    ] = "accuracy",
    margin: Annotated[
        float,
        typer.Option(help="How much the candidate must beat the champion by (0.01 = 1 point)."),
    ] = 0.0,
    name: ModelName = None,
) -> None:
    """Give the candidate the champion alias if it beats the champion on the holdout (via ONNX)."""
    from tasks.registry.promote import promote as run
    from tasks.registry.promote import reused_versions

    decision = run(
        holdout, candidate=candidate, metric=metric, margin=margin, settings=_with_model_name(name)
    )
    verdict = "is now @champion" if decision.promoted else "stays where it is"
    out.print(f"{decision.name} v{decision.challenger_version} {verdict}: {decision.reason}")
    if reused := reused_versions(decision):
        versions = ", ".join(f"v{v}" for v in reused)
        out.print(f"(score of {versions} on this holdout read from the registry, not scored again)")


@app.command("register-webhook")
def register_webhook(
    receiver_url: Annotated[
        str, typer.Argument(help="The receiver's URL, e.g. http://127.0.0.1:8765/mlflow/webhook.")
    ],
    mlflow_url: Annotated[
        str | None, typer.Option(help="The MLflow server (default: the tracking URI).")
    ] = None,
    test: Annotated[
        bool, typer.Option(help="Have MLflow send its test delivery and check it arrives.")
    ] = True,
) -> None:
    """Create the MLflow webhook that tells the receiver when a model version gets an alias."""
    from app.webhook import register_webhook as run

    out.print(f"webhook {run(receiver_url, mlflow_url=mlflow_url, test=test)} is active")
