"""Inference commands: Export to ONNX, INT8 quantization, Score Image Model, Evaluate Model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from app.cli.root import (
    _data_argument,
    _option,
    _with_options,
    app,
    out,
)


@app.command()
def export(
    model_dir: Annotated[Path, typer.Argument(help="Trained ModelDirectory.")],
    sample: Annotated[
        Path | None, typer.Option(help="ImageDirectory whose images check ONNX against PyTorch.")
    ] = None,
) -> None:
    """Export to ONNX (dynamic batch) and check it against PyTorch."""
    from tasks.inference.export import export_onnx

    result = export_onnx(model_dir, sample=sample)
    out.print(f"{result.path} (max abs difference vs PyTorch: {result.max_abs_diff:.2e})")


@app.command()
def quantize(
    model_dir: Annotated[Path, typer.Argument(help="Exported ModelDirectory (has model.onnx).")],
    calibration: Annotated[
        Path, typer.Argument(help="ImageDirectory whose images set the INT8 ranges (train).")
    ],
    validation: Annotated[
        Path, typer.Argument(help="Labeled ImageDirectory both models are measured on (val).")
    ],
    max_top1_drop: Annotated[
        float,
        typer.Option(help="Most top-1 (percentage points) INT8 may lose; above it, none is kept."),
    ] = 0.5,
    calibration_images: Annotated[
        int, typer.Option(help="Calibration images, spread evenly over the classes.")
    ] = 256,
) -> None:
    """Static INT8 (QDQ) quantization with ONNX Runtime, kept only if top-1 holds up."""
    from tasks.inference.quantize import quantize as run

    result = run(
        model_dir,
        calibration,
        validation,
        max_top1_drop=max_top1_drop,
        calibration_images=calibration_images,
    )
    out.print(
        f"{result.path}: top-1 {result.int8_top1:.2%} vs fp32 {result.fp32_top1:.2%} "
        f"(drop {result.top1_drop:.2f} points)"
    )


CLUSTER_OPTIONS = _with_options(
    _option(
        "cluster",
        None,
        str | None,
        typer.Option(
            help="Score as one job on this Ray cluster (HOST:6379, its head; 'team': the "
            "team's, IMAGEOPS_RAY_ADDRESS from the join file): Ray Data's tasks "
            "read the images, actors with an ONNX Runtime session each score them (THREADS "
            "cores each, default 1, or a GPU each), a part of the table per --shard-images "
            "images; a lost node's work is redone on the others. A local folder of images must "
            "be at the same path on every node; an s3:// prefix is read by the nodes "
            "themselves, with their own keys."
        ),
    ),
    _option("cluster_timeout_s", 60, int, typer.Option(help="How long to wait for the cluster.")),
)


@app.command()
@CLUSTER_OPTIONS
def score(
    model: Annotated[
        str,
        typer.Argument(
            help="Exported ModelDirectory, or a registry URI: models:/<name>@<alias> or "
            "models:/<name>/<version> (downloaded into the local cache)."
        ),
    ],
    images: Annotated[
        str,
        typer.Argument(
            help="ImageDirectory or any folder of images, or a data set version as NAME@VERSION "
            "(digits/val@latest: fetched from the DVC remote), or an s3://BUCKET/PREFIX of images "
            "(read as they are scored, never copied to disk)."
        ),
    ],
    dest: Annotated[
        str,
        typer.Argument(
            help="Scored table to write (.csv or .parquet), or an s3://BUCKET/PREFIX: Parquet "
            "parts and a _SUCCESS marker written last (CSV parts when the prefix ends in .csv)."
        ),
    ],
    batch_size: Annotated[int, typer.Option(help="Images per ONNX Runtime call.")] = 64,
    threads: Annotated[
        int | None, typer.Option(help="ONNX Runtime threads (default: the cores available).")
    ] = None,
    quantized: Annotated[
        bool, typer.Option(help="Score with the INT8 model (model.int8.onnx, `imageops quantize`).")
    ] = False,
    shard_images: Annotated[
        int,
        typer.Option(
            help="Images per shard; a larger input is scored shard by shard. Finished shards are "
            "kept (in .imageops-shards beside DEST) until the table is written, so the same "
            "command run again after a crash scores only the missing ones: smaller shards lose "
            "less work to a crash, larger ones start ONNX Runtime fewer times.",
        ),
    ] = 20_000,
    **on_cluster: Any,
) -> None:
    """Score Image Model with ONNX Runtime, in batches; unreadable images become reported rows."""
    from tasks.cluster.connect import cluster_address
    from tasks.registry.model_uri import model_in_use
    from tasks.shared.object_store import S3Url, is_s3_url
    from tasks.shared.settings import get_settings
    from tasks.shared.step import step_logger

    # 'team' resolved before anything is fetched: a machine in no team is refused at once.
    address = cluster_address(
        on_cluster["cluster"], get_settings(), step_logger(__name__), required=True
    )
    with model_in_use(model) as model_dir:  # a URI's cache folder: gc leaves it until the end
        # The model first (it may fail), then the images: an S3 prefix or a folder here.
        source = (
            S3Url.parse(images)
            if is_s3_url(images)
            else _data_argument(images, "images to score").path
        )
        target = S3Url.parse(dest) if is_s3_url(dest) else Path(dest)
        if address:
            from tasks.inference.score.on_cluster import ClusterScoring, score_on_cluster

            job = ClusterScoring(
                model_dir, source, target, address, batch_size, threads, quantized,
                on_cluster["cluster_timeout_s"], shard_images,
            )  # fmt: skip
            written = score_on_cluster(job)
        else:
            from tasks.inference.score import score_in_shards

            written = score_in_shards(
                model_dir,
                source,
                target,
                shard_images=shard_images,
                batch_size=batch_size,
                threads=threads,
                quantized=quantized,
            )
    out.print(f"wrote {written}")


@app.command()
def evaluate(
    scored: Annotated[Path, typer.Argument(help="Scored table of a labeled ImageDirectory.")],
    compare: Annotated[
        Path | None,
        typer.Option(
            help="A second scored table (e.g. the same images scored by another model), "
            "evaluated side by side; logged as eval_compare_<metric>."
        ),
    ] = None,
    run_id: Annotated[
        str | None,
        typer.Option(help="MLflow run to log the metrics and files into (e.g. the training run)."),
    ] = None,
    new_run: Annotated[
        bool,
        typer.Option(
            "--new-run",
            help="Log the metrics and files into a new MLflow run. Without it or --run-id, "
            "nothing goes to MLflow: the results are the files written beside the table.",
        ),
    ] = False,
    images: Annotated[
        Path | None,
        typer.Option(
            help="The folder that was scored: draws the most confidently wrong images as a "
            "gallery (<table>.wrong.png). Without it, no gallery."
        ),
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            help="The ModelDirectory that scored the table (with --images): Grad-CAM of the "
            "predicted class on the most confidently wrong images (<table>.gradcam.png), to "
            "see what the network looked at."
        ),
    ] = None,
) -> None:
    """Evaluate Model: accuracy, top-5, macro and weighted precision/recall/F1, confusion matrix,
    per-class ROC and PR areas (one vs rest), calibration (ECE).

    Writes <table>.metrics.json, per-class tables, the confusion matrix (PNG and JSON), the ROC
    and PR curves (<table>.roc_pr.png), the reliability diagram (<table>.calib.png, bins in
    .calib.json) and, with --images, the most confidently wrong images (and, with --model, their
    Grad-CAM) beside the scored table.
    """
    from tasks.inference.evaluate import evaluate as run
    from tasks.shared.artifacts import for_people
    from tasks.shared.errors import InvalidParameterError

    if run_id is not None and new_run:
        raise InvalidParameterError(
            "--run-id and --new-run were both given.",
            "Give --run-id to log into that run, or --new-run to log into a new one.",
        )
    if model is not None and images is None:
        raise InvalidParameterError(
            "--model was given without --images.",
            "Grad-CAM needs the scored images: add --images FOLDER (the folder that was scored).",
        )
    log = run_id is not None or new_run
    result = run(
        scored, compare=compare, run_id=run_id, log_to_mlflow=log, images=images, model=model
    )
    if result.compared is None:
        for key, value in result.metrics.items():
            out.print(f"{key}: {for_people(value)}")
        return
    out.print(f"{'metric':<20} {scored.name:>14} {compare.name:>14}")
    for key, value in result.metrics.items():
        shown = for_people(value), for_people(result.compared[key])
        out.print(f"{key:<20} {shown[0]!s:>14} {shown[1]!s:>14}")
