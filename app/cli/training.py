"""Model and training commands: DenseNet / ResNet directories, ``train`` (DDP), ``tune``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from app.cli.root import (
    _config,
    _data_argument,
    _given,
    _option,
    _options_from,
    _start_prefect_api,
    _with_options,
    app,
    model_app,
    out,
)
from models.transform_spec import TransformSpec
from models.untrained import ModelChoice
from tasks.shared.settings import get_settings
from tasks.train.params import TrainParams


@model_app.command("resnet")
def model_resnet(
    dest: Annotated[Path, typer.Argument(help="UntrainedModelDirectory to write.")],
    name: Annotated[
        str,
        typer.Option(
            help="resnet18/34/50/101/152, resnext50_32x4d, resnext101_32x8d, wide_resnet50_2, "
            "wide_resnet101_2."
        ),
    ] = "resnext101_32x8d",
    pretrained: Annotated[bool, typer.Option(help="Start from ImageNet weights.")] = True,
    zero_init_residual: Annotated[
        bool, typer.Option(help="Zero-init the last BN of each residual block.")
    ] = False,
) -> None:
    """ResNet component (Azure defaults: resnext101_32x8d, pretrained)."""
    from tasks.train.build_model import build_model

    build_model(
        {"name": name, "pretrained": pretrained, "zero_init_residual": zero_init_residual}, dest
    )
    out.print(f"wrote {name} to {dest}")


@model_app.command("densenet")
def model_densenet(
    dest: Annotated[Path, typer.Argument(help="UntrainedModelDirectory to write.")],
    name: Annotated[
        str, typer.Option(help="densenet121, densenet161, densenet169, densenet201.")
    ] = "densenet201",
    pretrained: Annotated[bool, typer.Option(help="Start from ImageNet weights.")] = True,
    memory_efficient: Annotated[
        bool, typer.Option(help="Checkpoint activations: less memory, slower.")
    ] = False,
) -> None:
    """DenseNet component (Azure defaults: densenet201, pretrained)."""
    from tasks.train.build_model import build_model

    build_model(
        {"name": name, "pretrained": pretrained, "memory_efficient": memory_efficient}, dest
    )
    out.print(f"wrote {name} to {dest}")


@model_app.command("build")
@_options_from(ModelChoice)
def model_build(
    dest: Annotated[Path, typer.Argument(help="UntrainedModelDirectory to write.")],
    config: Annotated[
        Path | None,
        typer.Option(
            help="params.yaml-shaped file: start from its `model` section (the options given "
            "replace its values)."
        ),
    ] = None,
    **options: Any,
) -> None:
    """Any network of the zoo by name (`imageops model list`), from params.yaml's `model`
    section and the options."""
    from tasks.train.build_model import build_model

    base = _config(config).model.model_dump() if config is not None else {}
    spec = build_model({**base, **_given(options)}, dest)
    out.print(f"wrote {spec.arch} to {dest}")


@model_app.command("list")
def model_list(
    timm: Annotated[
        str | None,
        typer.Option(
            help="Also list timm's models whose names match this pattern (e.g. '*convnext*'; "
            "'*' for all 1,000 and more), each usable as --name timm/<name>."
        ),
    ] = None,
    pretrained: Annotated[
        bool,
        typer.Option(help="With --timm: only names with published weights (their tags)."),
    ] = False,
) -> None:
    """Every architecture of the zoo, family by family: names for `model build --name`."""
    from models.untrained import FAMILIES

    for family in FAMILIES.values():
        if family.prefix is None:
            out.print(f"[bold]{family.title}[/bold]: {', '.join(family.archs)}")
        else:
            out.print(f"[bold]{family.title}[/bold]: {family.prefix}<name> (see --timm)")
    if timm is not None:
        from models.pretrained import timm as timm_module

        names = timm_module().list_models(timm, pretrained=pretrained)
        out.print("\n".join(f"timm/{name}" for name in names) or f"no timm model matches {timm!r}")


@app.command()
@_options_from(TrainParams)
def train(
    model: Annotated[Path, typer.Argument(help="UntrainedModelDirectory (imageops model ...).")],
    train_data: Annotated[
        str,
        typer.Argument(
            help="Labeled training ImageDirectory, or a data set version as NAME@VERSION "
            "(digits/train@latest, digits/train@<md5>: fetched from the DVC remote)."
        ),
    ],
    val_data: Annotated[
        str, typer.Argument(help="Labeled validation ImageDirectory, or a version of one.")
    ],
    dest: Annotated[Path, typer.Argument(help="ModelDirectory to write (the best epoch).")],
    config: Annotated[
        Path | None,
        typer.Option(
            help="params.yaml-shaped file: start from its `train` section (the options given "
            "replace its values). Without it: Train PyTorch Model's defaults with the modern "
            "recipe (--recipe azure: the Azure component's exact defaults)."
        ),
    ] = None,
    transform: Annotated[
        Path | None,
        typer.Option(
            help="TransformationDirectory (imageops transform init). Default: the transform the "
            "data was prepared with (imageops transform apply), else Init Image "
            "Transformation's defaults (resize 256, center crop 224, horizontal flip). Data "
            "prepared with another transform is refused."
        ),
    ] = None,
    **options: Any,
) -> None:
    """Train PyTorch Model (DDP); metrics and logs go to MLflow.

    One machine: torchrun here. --cluster HOST:6379 --nodes N: one gang of N nodes on that Ray
    cluster, one node's processes per machine (the data sets are versioned with DVC first: every
    node gets them from the remote).
    """
    from models.untrained import read_untrained
    from tasks.train import launch
    from tasks.train.request import TrainRequest
    from tasks.train.torchrun import trainings_stop_with_the_command

    base = _config(config).train.model_dump() if config is not None else {}
    # The parameters first (nothing is read for a request refused anyway), then Azure's order:
    # the model is refused before the data is looked for (or fetched).
    request = TrainRequest.checked(
        model=model, train_data=Path(train_data), val_data=Path(val_data), out=dest,
        transform=transform, params={**base, **_given(options)},
    )  # fmt: skip
    read_untrained(model)
    train = _data_argument(train_data, "training data")
    val = _data_argument(val_data, "validation data")
    request = request.model_copy(
        update={
            "train_data": train.path,
            "val_data": val.path,
            "data_version": {k: d.md5 for k, d in (("train", train), ("val", val)) if d.md5},
        }
    )
    out.print(_transform_note(transform, train.path, val.path))
    with trainings_stop_with_the_command():  # SIGTERM too: the MLflow run ends KILLED
        result = launch.train(request)
    out.print(f"model: {result.model_dir}  MLflow run: {result.run_id}  metrics: {result.metrics}")


def _transform_note(transform: Path | None, *data: Path) -> str:
    """Which transform the run takes, in words: a user must never train at a size by surprise."""
    from tasks.data.transform import applied_to, input_size, read_transformation

    if transform is not None:
        side = input_size(read_transformation(transform))
        return escape(f"transform: {transform} (the network sees {side}x{side} images)")
    applied = next((a for a in map(applied_to, data) if a is not None), None)
    if applied is not None:
        side = input_size(applied.spec)
        return f"transform: the one the data was prepared with ({side}x{side} images)"
    side = input_size(TransformSpec())
    return (
        f"transform: Init Image Transformation's defaults ({side}x{side} images); give "
        "--transform for another"
    )


# What `imageops tune` may replace in the spec file, by the spec's own field names.
_SPEC_OPTIONS = (
    _option(
        "study_name",
        None,
        str | None,
        typer.Option(
            "--study",
            help="Study name (replaces the file's); the same name continues a stopped study.",
        ),
    ),
    _option(
        "max_trial_count",
        None,
        int | None,
        typer.Option("--max-trials", help="Replace max_trial_count."),
    ),
    _option(
        "parallel_trial_count",
        None,
        int | None,
        typer.Option("--parallel", help="Replace parallel_trial_count."),
    ),
)


@app.command()
@_with_options(*_SPEC_OPTIONS)
def tune(
    spec: Annotated[Path, typer.Argument(help="Tuning spec (YAML, the shape of tuning.yaml).")],
    train_data: Annotated[
        str,
        typer.Option(
            help="Labeled training ImageDirectory, or a data set version as NAME@VERSION "
            "(digits/train@latest: fetched from the DVC remote)."
        ),
    ] = "data/digits/train",
    val_data: Annotated[
        str,
        typer.Option(
            help="Labeled validation ImageDirectory (the metric is measured on it), or a "
            "version of one."
        ),
    ] = "data/digits/val",
    transform: Annotated[
        Path | None,
        typer.Option(
            help="TransformationDirectory (imageops transform init). Default: the transform the "
            "data was prepared with (imageops transform apply), else the demo's (32x32 digits, "
            "as tuning.yaml's example study expects)."
        ),
    ] = None,
    register: Annotated[
        bool, typer.Option(help="Export and register the best trial's model as @challenger.")
    ] = True,
    trial_deployment: Annotated[
        str | None,
        typer.Option(
            help="Run each trial as a flow run of this deployment on its work pool "
            "(imageops-tune-trial/tune-trial; needs IMAGEOPS_TUNING_STORAGE and a Prefect server)."
        ),
    ] = None,
    **replaced: Any,
) -> None:
    """Tune hyperparameters with Optuna: each trial a training run; best model -> @challenger."""
    api_ready = _start_prefect_api(get_settings())
    from flows.config import DEMO_TRANSFORM
    from flows.tune import study_transform, tune_flow, tune_spec_file
    from tasks.data.transform import input_size, read_transformation
    from tasks.train.torchrun import trainings_stop_with_the_command

    study_spec = tune_spec_file(spec, **replaced)
    given = read_transformation(transform) if transform is not None else None
    train = _data_argument(train_data, "training data")
    val = _data_argument(val_data, "validation data")
    chosen = study_transform(given, train.path, val.path)
    side = input_size(chosen)
    source = transform or ("the data's" if chosen != DEMO_TRANSFORM else "the demo's")
    out.print(escape(f"transform: {source} (the network sees {side}x{side} images)"))
    api_ready()
    with trainings_stop_with_the_command():  # Ctrl-C or SIGTERM stops the running trials too
        result = tune_flow(
            study_spec,
            train.ref or str(train.path),
            val.ref or str(val.path),
            transform=chosen,
            register_best=register,
            trial_deployment=trial_deployment,
        )
    out.rule(f"study {result.study_name}")
    for trial in result.trials:
        value = "" if trial.value is None else f"{trial.value:.4f}"
        state = "INTERRUPTED" if trial.interrupted else trial.state
        out.print(f"  trial {trial.number:>3} {state:<11} {value:>8}  {trial.values}")
    if result.best is not None:
        out.print(f"  best: trial {result.best.number}, {result.metric} = {result.best.value:.4f}")
        out.print(f"  model: {result.best.model_dir}  MLflow run: {result.best.run_id}")
    if result.registered_version is not None:
        out.print(f"  registered version {result.registered_version} as @challenger")
    out.print(f"  trials table: {result.folder / 'trials.csv'}  study: {result.storage}")
