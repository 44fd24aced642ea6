"""Batch scoring as a flow, and its deployment that a promotion in the MLflow registry starts.

Composition only: resolve the model (a ModelDirectory path, or a ``models:/`` URI fetched from the
registry into the local cache), then the score task, or one per shard of a large input
(:func:`score_in_flow`). The deployment carries a trigger on the
alias event of :mod:`tasks.registry.promotion_events`, so a version becoming ``@champion`` runs this
flow with ``model="models:/<name>/<version>"`` (the version the event names) and ``cluster="team"``
(the team's Ray cluster on a machine of a team, else that machine), whether the event came from
MLflow's webhook (through ``app/webhook.py``) or from the promote step in embedded mode.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from prefect import serve
from prefect.deployments.runner import RunnerDeployment
from prefect.events import DeploymentEventTrigger
from prefect.futures import wait
from pydantic import BaseModel

from tasks.cluster.connect import TEAM, cluster_address
from tasks.data.data_refs import REF_SYNTAX, resolve_data
from tasks.inference.score import (
    SHARD_IMAGES,
    ClusterScoring,
    ShardedScoring,
    ShardJob,
    default_threads,
    run_in_turn,
    score_on_cluster_task,
    score_sharded,
    score_task,
)
from tasks.inference.score.report import score_markdown
from tasks.registry.model_uri import fetch_registered_model_task, is_registry_uri, leased
from tasks.registry.promotion_events import CHAMPION, alias_trigger
from tasks.shared.artifacts import publish_markdown
from tasks.shared.errors import ImageOpsError, error_text
from tasks.shared.flow_parameters import checked_flow
from tasks.shared.forms import form_field, form_schema
from tasks.shared.object_store import S3Url, is_s3_url
from tasks.shared.settings import Settings, get_settings, redact_uri
from tasks.shared.step import in_prefect_run, name_flow_run, named_from_parameters, step_logger

DEPLOYMENT_NAME = "score"
SCORING_REPORT = "scoring-report"
SCORES_DIR = "scores"


def submit_shards(jobs: Sequence[ShardJob]) -> None:
    """Score the jobs as ``score`` tasks of the running flow, side by side.

    ONNX Runtime and image decoding release the GIL, so the flow's threads run the shards at once,
    the cores split between them. A whole input (one job, no shard) is one task run here; outside
    a flow the jobs run one after another. Raises the first shard's error, if any.
    """
    if not in_prefect_run():
        run_in_turn(jobs)
        return
    if len(jobs) == 1 and jobs[0].shard is None:
        score_task(**jobs[0].arguments())
        return
    threads = jobs[0].threads if jobs else None
    per_shard = max(1, (threads or default_threads()) // max(1, len(jobs)))
    futures = [score_task.submit(**replace(job, threads=per_shard).arguments()) for job in jobs]
    wait(futures)
    for future in futures:
        future.result()  # raises the first shard's error, if any


def score_in_flow(scoring: ShardedScoring) -> Path | S3Url:
    """:func:`tasks.inference.score.score_sharded` with each missing shard a parallel ``score``
    task."""
    return score_sharded(scoring, submit_shards)


class ScoreResult(BaseModel):
    """What a scoring run used and wrote."""

    model: str  # as asked: a path or a models:/ URI
    model_dir: Path  # the ModelDirectory scored with (a cache folder for a URI)
    version: int | None  # the registry version a URI resolved to
    scored: Path | str  # the table: a path, or an s3:// prefix
    cluster: str | None = None  # the Ray cluster it scored on; None: this machine


def first_name(parameters: dict[str, Any]) -> str:
    """The score run's name from its parameters, before the model is resolved:
    ``score-imageops-classifier-champion-val``; the flow makes it the version's once it knows it
    (``score-imageops-classifier-v3-val``)."""
    model = parameters.get("model") or f"models:/{get_settings().registered_model_name}@champion"
    label = model.removeprefix("models:/").replace("@", "-").replace("/", "-")
    if not is_registry_uri(model):
        label = Path(model).name
    return f"score-{label}-{Path(str(parameters['images'])).name}"


@checked_flow(
    name="imageops-score", log_prints=True, flow_run_name=named_from_parameters(first_name)
)
def score_flow(
    model: Annotated[
        str | None,
        form_field(
            title="Model",
            description="A ModelDirectory path, models:/<name>@<alias> or models:/<name>/<version>;"
            " default: models:/<registered model name>@champion.",
        ),
    ] = None,
    images: Annotated[
        str,
        form_field(
            title="Images",
            description="ImageDirectory or image folder to score: a path from the project root, "
            f"or a data set version as {REF_SYNTAX}, e.g. digits/val@latest (fetched from the "
            "DVC remote), or s3://BUCKET/PREFIX (read as scored, never copied to disk).",
        ),
    ] = "data/digits/val",
    dest: Annotated[
        str | None,
        form_field(
            title="Scored table",
            description=".csv or .parquet, or s3://BUCKET/PREFIX (Parquet parts, CSV parts when "
            "it ends in .csv, and a _SUCCESS marker written last); "
            "default: <home>/scores/<model>-<UTC time>.csv.",
        ),
    ] = None,
    batch_size: Annotated[
        int,
        form_field(gt=0, title="Batch size", description="Images per ONNX Runtime call."),
    ] = 64,
    shard_images: Annotated[
        int,
        form_field(
            gt=0,
            title="Images per shard",
            description="A larger input is cut into shards scored by parallel tasks; "
            "finished shards are kept until the table is written, so a rerun after a crash "
            "scores only the missing ones.",
        ),
    ] = SHARD_IMAGES,
    threads: Annotated[
        int | None,
        form_field(
            gt=0,
            title="Threads",
            description="Default: the cores available; on a cluster, ONNX Runtime's per actor "
            "(default 1).",
        ),
    ] = None,
    cluster: Annotated[
        str | None,
        form_field(
            title="Ray cluster",
            description="Score as one job on this Ray cluster (host:6379 of its head): Ray "
            "Data's tasks read, actors with an ONNX Runtime session each score (a GPU each when "
            "the cluster has GPUs). A local folder of images must be at the same path on every "
            "node; an s3:// prefix is read by the nodes themselves. "
            f"'{TEAM}': the team's cluster when this machine is in one (IMAGEOPS_RAY_ADDRESS, "
            "from the join file), else this machine; a promotion's run passes it. "
            "Default: this machine.",
        ),
    ] = None,
) -> ScoreResult:
    """Score ``images`` with ``model``; relative paths are under the project root."""
    settings = get_settings()
    model = model or f"models:/{settings.registered_model_name}@{CHAMPION}"
    version, cached = None, None
    if is_registry_uri(model):
        cached = fetch_registered_model_task(model)
        model_dir, version = cached.path, cached.version
        label = f"{cached.path.parent.name}-v{cached.version}"
    else:
        model_dir = settings.project_root / model
        label = model_dir.name
    folder = (
        S3Url.parse(images)
        if is_s3_url(images)
        else resolve_data(images, "images to score", settings).path
    )
    name_flow_run(f"score-{label}-{Path(images).name}")
    if dest is None:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        out = settings.home_dir / SCORES_DIR / f"{label}-{stamp}.csv"
    else:
        out = S3Url.parse(dest) if is_s3_url(dest) else settings.project_root / dest
    address = cluster_address(cluster, settings, step_logger(__name__))
    # One score task, or parallel ones over shards for a large input, merged in order; a cache
    # folder leased meanwhile, so `imageops gc` leaves it (the same folder, fetched again if a gc
    # took it since the fetch).
    with leased(cached, settings) if cached else nullcontext():
        if address:
            job = ClusterScoring(
                model_dir, folder, out, address, batch_size, threads, shard_images=shard_images
            )
            scored = score_on_cluster_task(job)
        else:
            scored = score_in_flow(
                ShardedScoring(
                    model_dir,
                    folder,
                    out,
                    shard_images=shard_images,
                    batch_size=batch_size,
                    threads=threads,
                )
            )
    where = f" on the Ray cluster at {address}" if address else ""
    print(f"Scored {images} with {model} ({model_dir}){where} into {scored}")
    if in_prefect_run():
        url = None
        if version is not None:  # the cache's folder is <registered name>/<version>
            from tasks.shared.tracking import model_version_url  # imports mlflow

            url = model_version_url(settings, model_dir.parent.name, version)
        report = score_markdown(model, version, url, images, scored)
        publish_markdown(SCORING_REPORT, report, f"Scoring of {images} with {model}")
    return ScoreResult(
        model=model,
        model_dir=model_dir,
        version=version,
        scored=scored if isinstance(scored, Path) else str(scored),
        cluster=address,
    )


def promotion_trigger(name: str, alias: str = CHAMPION) -> DeploymentEventTrigger:
    """The deployment's trigger: a version of ``name`` becoming ``@alias`` scores that version,
    on the team's Ray cluster when the worker's machine is in a team (``cluster=team``)."""
    return alias_trigger(name, alias, parameters={"cluster": TEAM})


def scoring_deployment(
    *,
    alias: str = CHAMPION,
    images: str | None = None,
    dest: str | None = None,
    name: str = DEPLOYMENT_NAME,
    settings: Settings | None = None,
) -> RunnerDeployment:
    """The scoring deployment, triggered when ``alias`` of the registered model is set.

    ``images`` and ``dest`` become the deployment's default parameters (the trigger passes only
    ``model``). The registered model name is the settings' (IMAGEOPS_REGISTERED_MODEL_NAME).
    """
    settings = settings or get_settings()
    defaults = {k: v for k, v in {"images": images, "dest": dest}.items() if v is not None}
    deployment = score_flow.to_deployment(
        name=name,
        description=f"Scores images with {settings.registered_model_name}@{alias}; runs when a "
        f"version becomes @{alias} in the MLflow registry.",
        parameters=defaults,
        triggers=[promotion_trigger(settings.registered_model_name, alias)],
        tags=["imageops", "scoring"],
    )
    deployment._parameter_openapi_schema = form_schema(score_flow)  # titled and described
    return deployment


def serve_scoring(
    *,
    alias: str = CHAMPION,
    images: str | None = None,
    dest: str | None = None,
    limit: int | None = None,
) -> None:
    """Serve the scoring deployment from this process until interrupted (needs a Prefect server).

    Export the settings (``Settings.apply``) before Prefect is imported, as the ``imageops`` CLI
    does; this checks that Prefect sees the same API as the settings say.
    """
    from prefect.settings import PREFECT_API_URL

    settings = get_settings()
    api = PREFECT_API_URL.value()
    if not api or (settings.prefect_api_url and api != settings.prefect_api_url):
        wanted = (
            f" (the settings say {redact_uri(settings.prefect_api_url)})"
            if settings.prefect_api_url
            else ""
        )
        raise ImageOpsError(
            "Serving needs a Prefect server; Prefect's API here is "
            f"{redact_uri(api) if api else 'not set'}{wanted}.",
            "Export PREFECT_API_URL (e.g. http://127.0.0.1:4200/api) before starting, or use the "
            "imageops CLI, which exports IMAGEOPS_PREFECT_API_URL first. Triggers need a "
            "`prefect server start`; the ephemeral API has none.",
        )
    serve(
        scoring_deployment(alias=alias, images=images, dest=dest, settings=settings),
        limit=limit,
        print_starting_message=False,
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m flows.score serve``: the triggered scoring deployment, without the CLI."""
    parser = argparse.ArgumentParser(prog="python -m flows.score")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser("serve", help="serve the scoring deployment with its trigger")
    serve_cmd.add_argument("--alias", default=CHAMPION)
    serve_cmd.add_argument(
        "--images", default=None, help="default parameter (flow: data/digits/val)"
    )
    serve_cmd.add_argument("--dest", default=None, help="default parameter (flow: <home>/scores)")
    serve_cmd.add_argument("--limit", type=int, default=None, help="concurrent runs at most")
    args = parser.parse_args(argv)
    get_settings().apply()
    try:
        serve_scoring(alias=args.alias, images=args.images, dest=args.dest, limit=args.limit)
    except ImageOpsError as exc:
        raise SystemExit(error_text(exc)) from None


if __name__ == "__main__":
    main()
