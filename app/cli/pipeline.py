"""``imageops run`` (the whole pipeline as one Prefect flow) and ``imageops serve`` (the stack)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from app.cli.root import (
    _print_commit_hint,
    _start_prefect_api,
    app,
    err,
    out,
    serve_app,
)
from tasks.shared.settings import Settings, get_settings, redact_uri
from tasks.train.params import MAX_EPOCHS

if TYPE_CHECKING:
    from app.stack import Stack


@serve_app.callback(invoke_without_command=True)
def serve_stack(
    ctx: typer.Context,
    host: Annotated[
        str,
        typer.Option(
            help="Interface the servers listen on. 127.0.0.1: this machine only; 0.0.0.0: "
            "every interface (put it behind a firewall or proxy: only Prefect has a login)."
        ),
    ] = "127.0.0.1",
    prefect_port: Annotated[int, typer.Option(help="Prefect server and UI port.")] = 4200,
    mlflow_port: Annotated[int, typer.Option(help="MLflow server and UI port.")] = 5000,
    receiver_port: Annotated[
        int, typer.Option(help="Port of the promotion receiver (MLflow's webhook target).")
    ] = 8765,
    ui: Annotated[bool, typer.Option(help="Serve the Prefect UI.")] = True,
    worker: Annotated[
        bool, typer.Option(help="Start a worker on the `local` process pool.")
    ] = True,
) -> None:
    """Bring the whole stack up on this machine; Ctrl-C stops all of it."""
    if ctx.invoked_subcommand is not None:
        return
    from app.stack import Ports, Stack

    stack = Stack(
        get_settings(),
        host=host,
        ports=Ports(prefect=prefect_port, mlflow=mlflow_port, receiver=receiver_port),
        ui=ui,
        worker=worker,
        say=lambda message: err.print(f"[dim]{message}[/]"),
    )
    err.print("starting the Prefect server, the MLflow server and the promotion receiver ...")
    stack.start()
    try:
        auth_file = stack.settings.prefect_auth_file
        login = f"(login: the auth string in {auth_file})"
        out.print(f"[bold]Prefect UI[/]  {stack.prefect_url}  {login}", soft_wrap=True)
        out.print(f"[bold]MLflow UI[/]   {_experiment_page(stack)}")
        out.print(f"[bold]Receiver[/]    {stack.receiver_url}")
        out.print(f"[bold]Worker[/]      {'pool `local`' if worker else 'none'}")
        out.print(f"[bold]Logs[/]        {stack.dir / 'logs'}")
        out.print("Use this stack from another shell (the prefect, mlflow and imageops commands):")
        out.print(
            f"  export PREFECT_API_URL={stack.prefect_api} MLFLOW_TRACKING_URI={stack.mlflow_url}",
            soft_wrap=True,  # one line, however narrow the terminal: it is copied as it is
        )
        out.print(
            f"  export IMAGEOPS_PREFECT_API_URL={stack.prefect_api} "
            f"IMAGEOPS_MLFLOW_TRACKING_URI={stack.mlflow_url}",
            soft_wrap=True,
        )
        # The file, not the secret: what serve prints may end up in a log others read.
        out.print(
            f'  export PREFECT_API_AUTH_STRING="$(cat {shlex.quote(str(auth_file))})"',
            soft_wrap=True,
        )
        out.print("[bold]ready[/]; Ctrl-C stops everything")
        stack.serve_forever()
    except KeyboardInterrupt:
        err.print("stopping ...")
    finally:
        said = stack.stop()
    err.print(said)


def _experiment_page(stack: Stack) -> str:
    """The MLflow UI's page of the project's experiment (created now if new), on its runs.

    Not MLflow's home page: MLflow 3's UI opens there, and on an experiment reached from its
    list, in its GenAI view (traces, token usage), with the runs and the registry out of the
    sidebar; the link asks for the model-training view (tasks.shared.tracking.ui_url)."""
    from tasks.shared.tracking import configure_mlflow, ui_url

    project = get_settings()
    settings = Settings(
        project_root=project.project_root,
        home=project.home_dir,
        mlflow_tracking_uri=stack.mlflow_url,
        mlflow_experiment=project.mlflow_experiment,
    )
    experiment = configure_mlflow(settings)
    return ui_url(settings, f"experiments/{experiment}/runs") or stack.mlflow_url


@serve_app.command("scoring")
def serve_scoring(
    alias: Annotated[
        str, typer.Option(help="The alias whose promotion starts a scoring run.")
    ] = "champion",
    images: Annotated[
        str | None, typer.Option(help="Images each run scores (default: data/digits/val).")
    ] = None,
    dest: Annotated[
        str | None, typer.Option(help="Table each run writes (default: <home>/scores/...).")
    ] = None,
    limit: Annotated[int | None, typer.Option(help="Concurrent scoring runs at most.")] = None,
) -> None:
    """Serve the batch-scoring deployment; a version getting ALIAS in MLflow starts a run."""
    from flows.score import serve_scoring as run

    run(alias=alias, images=images, dest=dest, limit=limit)


@serve_app.command("webhook")
def serve_webhook(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8765,
) -> None:
    """Receive MLflow registry webhooks (HMAC-checked with IMAGEOPS_WEBHOOK_SECRET) as events."""
    from app.webhook import serve

    serve(host=host, port=port)


@app.command("run")
def run_pipeline(
    source: Annotated[
        str | None,
        typer.Argument(
            help="Raw images (folder or archive), or a version of them as NAME@VERSION "
            "(raw/digits@latest: fetched from the DVC remote). Default: data/raw/digits (the "
            "digits; its latest version in the DVC remote when this machine lacks it)."
        ),
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="params.yaml-shaped file with the pipeline parameters.")
    ] = None,
    dataset: Annotated[
        str | None,
        typer.Option(
            help="Data set name: the prepared data goes to data/NAME/images, train and val "
            "(default: the source's folder or archive name). Runs on different data sets run at "
            "once; runs on the same one take turns."
        ),
    ] = None,
    epochs: Annotated[
        int | None, typer.Option(help=f"Override the training epochs (1 to {MAX_EPOCHS:,}).")
    ] = None,
    nproc_per_node: Annotated[
        int | None, typer.Option(help="Override the training processes.")
    ] = None,
    recipe: Annotated[
        str | None,
        typer.Option(
            help="Override the training recipe: modern (the default, the best measured) or "
            "azure (the Azure component's exact defaults)."
        ),
    ] = None,
) -> None:
    """Run the whole pipeline as a Prefect flow and print where to look."""
    settings = get_settings()
    from tasks.data.data_refs import latest_version, parse_ref

    ref = None if source is None or Path(source).exists() else parse_ref(source, settings)
    if source is not None and not Path(source).exists() and ref is None:
        from tasks.shared.errors import NoUsableImagesError  # before anything starts

        raise NoUsableImagesError(
            f"{source} does not exist.",
            "Pass a folder of images (one sub-folder per class), an archive of one, a CSV / "
            "COCO label file, or a version of one as NAME@VERSION (raw/digits@latest); with no "
            "SOURCE, imageops run uses the digits sample.",
        )
    from flows.config import PipelineConfig

    cfg = PipelineConfig.from_yaml(config) if config else PipelineConfig()
    if (
        source is None
        and not (settings.project_root / cfg.source).exists()
        and latest_version(cfg.source, settings) is None
    ):
        from tasks.data.sample import write_digits

        out.print(f"{cfg.source} is missing: writing the digits sample there first")
        write_digits(settings.project_root / cfg.source)
    updates: dict = {}
    if source is not None:
        updates["source"] = str(ref) if ref is not None else str(Path(source).resolve())
    if dataset is not None:
        updates["dataset"] = dataset
    train_updates = {
        k: v
        for k, v in {"epochs": epochs, "nproc_per_node": nproc_per_node, "recipe": recipe}.items()
        if v is not None
    }
    if train_updates:  # as values, checked below with the rest (model_copy checks nothing)
        updates["train"] = cfg.train.model_dump() | train_updates
    cfg = PipelineConfig.checked(
        {**cfg.model_dump(), **updates},
        "imageops run",
        "Fix the option; `imageops run --help` lists every one.",
    )

    cfg.check_sources(settings)  # a refused run starts nothing and leaves nothing behind
    # The temporary API comes up while the flow's libraries import.
    api_ready = _start_prefect_api(settings)
    from flows.pipeline import pipeline
    from tasks.train.torchrun import trainings_stop_with_the_command

    api_ready()
    with trainings_stop_with_the_command():  # Ctrl-C or SIGTERM stops its training too
        result = pipeline(cfg)
    _print_summary(settings, result)
    # The versioned folders of this project (a source fetched by version is not one).
    parts = [settings.data_path / ref.rpartition("@")[0] for ref in result.data_refs.values()]
    parts = [part for part in parts if part.exists()]
    if parts:
        _print_commit_hint(parts, f"Data set {result.dataset}")


def _print_summary(settings: Settings, result) -> None:
    from rich.table import Table

    from flows.pipeline import format_metric

    out.rule(f"imageops run finished: data set {result.dataset}")
    for key, value in sorted(result.metrics.items()):
        out.print(f"  {key:<24} {format_metric(key, value)}")
    out.print(escape(f"  model directory          {result.model_dir}"))
    out.print(escape(f"  scored table             {result.scored}"))
    out.print(escape(f"  outputs                  {result.outputs}"))
    out.print(f"  registered model         {result.registered_model} v{result.registered_version}")
    if result.champion:
        champion = f"v{result.champion_version}, this run's model"
    else:
        champion = f"v{result.champion_version} stays" if result.champion_version else "none"
    out.print(escape(f"  champion                 {champion}: {result.promotion_reason}"))
    out.print(f"  MLflow run               {result.mlflow_run_id}")
    versions = Table("data set", "NAME@md5", title="data versions", title_justify="left")
    for name, md5 in result.data_version.items():
        versions.add_row(name, result.data_refs.get(name, md5))
    if result.data_version:
        out.print(versions)
    mlflow_bin = Path(sys.executable).parent / "mlflow"
    out.print(
        f"  look at it: {mlflow_bin} ui --backend-store-uri {redact_uri(settings.tracking_uri)} "
        f"--default-artifact-root {settings.artifact_location}"
    )
