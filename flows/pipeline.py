"""The whole pipeline as one Prefect flow, from raw images to a registered, evaluated model.

Composition only: every step is a task from ``tasks/`` that does its own work and retries on its
own; this flow says which, in what order, with what.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

from prefect.context import FlowRunContext
from pydantic import BaseModel

from flows.config import PipelineConfig
from flows.score import score_in_flow
from flows.train import train_and_report
from tasks.data.convert import convert_task
from tasks.data.data_refs import ResolvedData
from tasks.data.datasets import dataset_lock
from tasks.data.split import split_task
from tasks.data.version_tags import dataset_name
from tasks.data.versioning import version_task
from tasks.inference.evaluate import evaluate_task
from tasks.inference.export import export_task
from tasks.inference.quantize import quantize_task
from tasks.inference.score import ShardedScoring
from tasks.registry.promote import CHALLENGER, Promotion, promote_task
from tasks.registry.register import register_task
from tasks.shared.artifacts import markdown_table, publish_markdown
from tasks.shared.flow_parameters import checked_flow
from tasks.shared.forms import form_field
from tasks.shared.settings import Settings, get_settings, redact_uri
from tasks.shared.step import name_flow_run
from tasks.shared.tracking import model_version_url, run_url
from tasks.train.build_model import build_model_task
from tasks.train.outputs_folder import outputs_folder
from tasks.train.request import TrainRequest


class PipelineResult(BaseModel):
    """What a run produced and where to look."""

    dataset: str  # the data set's name: its prepared folders are data/<dataset>/
    outputs: Path
    model_dir: Path
    scored: Path
    mlflow_run_id: str
    registered_model: str
    registered_version: str
    champion: bool  # whether this run's model took the champion alias
    champion_version: str | None = None  # the champion after this run's promotion decision
    promotion_reason: str = ""  # why: the metric of both models, the gain, the margin
    data_version: dict[str, str]
    data_refs: dict[str, str] = {}  # part -> name@md5: the same data again, from any machine
    metrics: dict[str, float]


# The form's defaults in the Prefect UI; the flow never changes the object it is given.
DEFAULT_CONFIG = PipelineConfig()


@checked_flow(name="imageops-pipeline", log_prints=True)
def pipeline(
    config: Annotated[
        PipelineConfig,
        form_field(
            title="Pipeline parameters",
            description="Every option of `imageops run` (params.yaml has the same shape).",
        ),
    ] = DEFAULT_CONFIG,
) -> PipelineResult:
    """Raw images in, a registered, exported, evaluated model out; champion if it beats the last."""
    settings = get_settings()
    # The run's page keeps what it was given (a partial override); the log keeps what it ran with.
    print(f"Pipeline parameters: {config.model_dump_json()}")
    name = config.dataset_name
    run_name = f"pipeline-{config.model.name}-{name}"
    name_flow_run(run_name)
    source, data = config.check_sources(settings)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")

    # From convert to the end: another run on this data set would replace the split mid-training.
    # The same parameters again after a stop: the same outputs, so the training resumes.
    with (
        dataset_lock(settings, name),
        outputs_folder(
            settings, f"{stamp}-{name}-{_run_id()}", config.model_dump_json()
        ) as outputs,
    ):
        convert_task(source.path, data / "images")
        split_task(
            data / "images", data / "train", data / "val",
            fraction=config.split.fraction, seed=config.split.seed,
        )  # fmt: skip
        versions: dict[str, ResolvedData] = {}
        if config.version_data:
            versions = versioned_data(source, data, settings)
            name_flow_run(f"{run_name}-data-{versions['images'].md5[:8]}")  # type: ignore[index]
        data_version = {part: str(d.md5) for part, d in versions.items()}
        data_refs = {part: str(d.ref) for part, d in versions.items()}

        request = TrainRequest(
            model=outputs / "untrained", train_data=data / "train", val_data=data / "val",
            out=outputs / "model", params=config.train, transform=config.transform,
            data_version=data_version,
        )  # fmt: skip
        build_model_task(config.model, request.model)
        # A sub-flow: on many nodes it runs one agent per node against one MLflow run.
        trained = train_and_report(request)
        export_task(trained.model_dir, sample=data / "val")
        if config.quantize:
            quantize_task(
                trained.model_dir, data / "train", data / "val", max_top1_drop=config.max_top1_drop
            )
        # Scored on the validation set as exported: the version's figures are the model's, and
        # the promotion below reuses that score (the same images) instead of scoring again.
        registered = register_task(
            trained.model_dir, data_version=data_version, alias=CHALLENGER, data_refs=data_refs,
            validation=data / "val",
        )  # fmt: skip
        promotion = promote_task(
            data / "val", candidate=registered.version,
            metric=config.promotion.metric, margin=config.promotion.margin,
        )  # fmt: skip
        # One score task, or parallel ones over shards for a large input.
        scored = score_in_flow(
            ShardedScoring(
                trained.model_dir, data / "val", outputs / "scored.csv",
                batch_size=config.score_batch_size,
            )
        )  # fmt: skip
        evaluation = evaluate_task(
            scored, run_id=trained.run_id, images=data / "val", model=trained.model_dir
        )

    result = PipelineResult(
        dataset=name,
        outputs=outputs,
        model_dir=trained.model_dir,
        scored=scored,
        mlflow_run_id=trained.run_id,
        registered_model=registered.name,
        registered_version=str(registered.version),
        champion=promotion.promoted,
        champion_version=_champion_after(promotion),
        promotion_reason=promotion.reason,
        data_version=data_version,
        data_refs=data_refs,
        metrics=dict(evaluation.metrics),
    )
    publish_markdown(
        "pipeline-summary",
        summary_markdown(result, settings),
        f"{result.registered_model} v{result.registered_version}: metrics and links",
    )
    return result


def versioned_data(source: ResolvedData, data: Path, settings: Settings) -> dict[str, ResolvedData]:
    """The run's data sets, each a version in the DVC remote (dvc add + push; ``latest`` moves).

    The source comes first when it is a data set of the project (under data/): its ``latest``
    is what a run on a machine without it starts from (the nightly deployment's default
    data/raw/digits). A source fetched by version is recorded as it is, not versioned again; one
    outside data/ is the user's folder, not a data set, and is not versioned. Then the prepared
    images, train and val.
    """
    versions = {}
    if source.md5 is not None:
        versions["source"] = source
    elif source.name is not None:
        versions["source"] = replace(source, md5=version_task(source.path))
    for part in ("images", "train", "val"):
        folder = data / part
        versions[part] = ResolvedData(folder, dataset_name(folder, settings), version_task(folder))
    return versions


def _champion_after(promotion: Promotion) -> str | None:
    if promotion.promoted:
        return str(promotion.challenger_version)
    return None if promotion.champion_version is None else str(promotion.champion_version)


def format_metric(name: str, value: float) -> str:
    """Counts as integers, scores with four decimals."""
    return f"{value:.0f}" if name.endswith("images") else f"{value:.4f}"


def _run_id() -> str:
    """This run's short id (its Prefect flow run's): outputs of runs in the same second differ."""
    context = FlowRunContext.get()
    if context is not None and context.flow_run is not None:
        return str(context.flow_run.id)[:8]
    return uuid.uuid4().hex[:8]


def summary_markdown(result: PipelineResult, settings: Settings) -> str:
    """The run at a glance: what it trained on, how well, where the model and its logs are."""
    run_page = run_url(settings, result.mlflow_run_id)
    logs_page = f"{run_page}/artifacts" if run_page else None
    version_page = model_version_url(settings, result.registered_model, result.registered_version)
    model = f"{result.registered_model} v{result.registered_version}"
    ui = f"`mlflow ui --backend-store-uri {redact_uri(settings.tracking_uri)}`"

    def link(text: str, url: str | None) -> str:
        return f"[{text}]({url})" if url else f"{text} (in {ui})"

    rows = [{"metric": k, "value": format_metric(k, v)} for k, v in sorted(result.metrics.items())]
    data = [
        {"data set": k, "DVC md5": v, "reference": result.data_refs.get(k, "")}
        for k, v in result.data_version.items()
    ]
    this = f"v{result.registered_version}"
    if result.champion:
        decision = f"{this} is now @champion ({result.promotion_reason})"
    else:  # this run's version and the champion named apart: "v4 stays @challenger; v3 ..."
        champion = f"v{result.champion_version}" if result.champion_version else "none"
        decision = f"{this} stays @challenger, {champion} @champion ({result.promotion_reason})"
    return "\n\n".join(
        part
        for part in (
            f"### {model}{' is now @champion' if result.champion else ' (@challenger)'}",
            f"- Promotion: {decision}",
            f"- Data set: `{result.dataset}` (`{settings.data_path / result.dataset}`)",
            f"- MLflow run: {link(result.mlflow_run_id, run_page)}",
            f"- Registered version: {link(model, version_page)}",
            f"- Per-rank training logs: {link('logs/ in the run artifacts', logs_page)}",
            f"- Scored table: `{result.scored}`",
            markdown_table(rows),
            markdown_table(data),
        )
        if part
    )
