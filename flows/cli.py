"""The ``imageops`` command line: one subcommand per pipeline step, and ``run`` for the whole flow.

Step subcommands call the plain step functions (no Prefect API needed); ``run`` runs the Prefect
flow. Heavy libraries are imported inside each command, after the settings have been exported to
the environment, so ``--help`` is quick and Prefect and MLflow see our locations.
"""

from __future__ import annotations

import inspect
import shlex
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape

from models.errors import ImageOpsError
from models.transform_spec import TransformSpec
from models.untrained import ModelChoice
from tasks.archive import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_MEMBER_BYTES,
    DEFAULT_MAX_MEMBERS,
    DEFAULT_MAX_RATIO,
)
from tasks.errors import error_summary
from tasks.settings import Settings, get_settings, redact_uri
from tasks.train.params import TrainParams

if TYPE_CHECKING:
    from flows.config import PipelineConfig

app = typer.Typer(
    name="imageops",
    help="Image classification MLOps: convert, version, split, train (DDP), tune, export, "
    "register, promote, score, evaluate. Locations come from IMAGEOPS_* environment variables "
    "(see the README).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
sample_app = typer.Typer(help="Write real sample data sets.", no_args_is_help=True)
model_app = typer.Typer(help="Write an UntrainedModelDirectory (DenseNet, ResNet).")
transform_app = typer.Typer(
    help="Init / Apply Image Transformation: save a transform spec, apply it to images.",
    no_args_is_help=True,
)
serve_app = typer.Typer(
    help="Serve: with no subcommand, the whole local stack (Prefect server and worker, MLflow "
    "server, promotion receiver, every deployment) until Ctrl-C; `scoring` and `webhook` serve "
    "one part for a Prefect server you run yourself.",
)
app.add_typer(serve_app, name="serve")
app.add_typer(sample_app, name="sample")
app.add_typer(model_app, name="model")
app.add_typer(transform_app, name="transform")

# soft_wrap: paths and URIs stay on one line, so they can be copied even from a narrow log.
err = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)


def _options_from(model: type[BaseModel]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command one ``--option`` per field of ``model``, its help read from the field.

    The CLI, the Prefect forms, params.yaml and tuning then share one definition: a field added
    to the model is an option here too. Every option defaults to None (not given), so only the
    options a person types replace the values the command starts from.
    """
    options = []
    for name, field in model.model_fields.items():
        default = field.get_default(call_default_factory=True)
        kind: Any = field.annotation
        if isinstance(default, list):  # mean, std: three numbers after the option
            kind = tuple[float, float, float]
            default = " ".join(str(v) for v in default)
        elif typing.get_origin(kind) is types.UnionType:  # int | None: None is the default
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        help_text = f"{field.title}: {field.description} Default: {default}."
        options.append(_option(name, None, kind | None, typer.Option(help=help_text)))
    return _with_options(*options)


def _option(name: str, default: Any, kind: Any, option: Any) -> inspect.Parameter:
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, option]
    )


def _with_options(
    *options: inspect.Parameter,
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Add ``options`` after a command's own parameters: they reach it in its ``**options``."""

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        params = [
            p
            for p in inspect.signature(command, eval_str=True).parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        command.__signature__ = inspect.Signature([*params, *options])  # type: ignore[attr-defined]
        return command

    return decorate


def _given(options: dict[str, Any]) -> dict[str, Any]:
    """The options a person typed (None: not given), tuples as the lists the models take."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in options.items() if v is not None}


@app.callback()
def _configure() -> None:
    """Export the settings before any command imports Prefect or MLflow."""
    get_settings().apply()


@sample_app.command("digits")
def sample_digits(
    dest: Annotated[Path, typer.Argument(help="Folder to write (one sub-folder per digit).")],
    size: Annotated[int, typer.Option(help="Side of the square PNGs, in pixels (>= 8).")] = 32,
    per_class: Annotated[
        int | None, typer.Option(help="Keep at most this many images per digit (default: all).")
    ] = None,
) -> None:
    """Write scikit-learn's 1,797 handwritten digits as RGB PNGs in class folders."""
    from tasks.sample import write_digits

    write_digits(dest, size=size, per_class=per_class)
    out.print(f"wrote digits to {dest}")


@app.command()
def convert(
    source: Annotated[Path, typer.Argument(help="Image folder or .zip/.tar/.tar.gz/.tar.bz2.")],
    dest: Annotated[Path, typer.Argument(help="ImageDirectory to write (replaced atomically).")],
    max_archive_members: Annotated[
        int, typer.Option(min=1, help="Refuse an archive of more members (archive bombs).")
    ] = DEFAULT_MAX_MEMBERS,
    max_archive_bytes: Annotated[
        int, typer.Option(min=1, help="Refuse an archive that inflates to more bytes in all.")
    ] = DEFAULT_MAX_BYTES,
    max_archive_member_bytes: Annotated[
        int, typer.Option(min=1, help="Skip a member that inflates to more bytes.")
    ] = DEFAULT_MAX_MEMBER_BYTES,
    max_archive_ratio: Annotated[
        int,
        typer.Option(
            min=1,
            help="Skip a member, or refuse the archive, that inflates to more times its size "
            "(past the first 16 MiB, where any ratio is allowed).",
        ),
    ] = DEFAULT_MAX_RATIO,
    workers: Annotated[
        int | None,
        typer.Option(
            help="Processes checking images, this one included (default: every core, once the "
            "input is large enough to gain from them; 1: this process only)."
        ),
    ] = None,
) -> None:
    """Convert to Image Directory: class sub-folders become labels; broken files are reported.

    Images over IMAGEOPS_MAX_PIXELS pixels (default 40,000,000) or an aspect ratio of
    IMAGEOPS_MAX_ASPECT_RATIO:1 (default 100) are skipped, as every other step refuses them.
    """
    from tasks.convert import ConvertLimits
    from tasks.convert import convert as run
    from tasks.imageformat import visible_name

    limits = ConvertLimits(
        max_archive_members=max_archive_members,
        max_archive_bytes=max_archive_bytes,
        max_archive_member_bytes=max_archive_member_bytes,
        max_archive_ratio=max_archive_ratio,
    )
    manifest = run(source, dest, limits, workers=workers)
    kind = f"{len(manifest.classes)} classes" if manifest.labeled else "unlabeled"
    # Names are the user's (a file may be called "[red].png"): printed as they are, not as markup.
    out.print(
        escape(f"{dest}: {len(manifest.images)} images, {kind}, {len(manifest.skipped)} skipped")
    )
    for item in manifest.skipped[:20]:
        out.print(escape(visible_name(f"  skipped {item.path}: {item.reason}")))


@app.command()
def split(
    source: Annotated[Path, typer.Argument(help="ImageDirectory to split.")],
    first: Annotated[Path, typer.Argument(help="First output (gets the fraction).")],
    second: Annotated[Path, typer.Argument(help="Second output (the rest).")],
    fraction: Annotated[float, typer.Option(help="Share of each class in FIRST, 0..1.")] = 0.9,
    seed: Annotated[int, typer.Option(help="Random seed: same seed, same split.")] = 1,
) -> None:
    """Split Image Directory, stratified by class."""
    from tasks.split import split as run

    a, b = run(source, first, second, fraction=fraction, seed=seed)
    out.print(f"{first}: {len(a.images)} images; {second}: {len(b.images)} images")


@app.command()
def version(
    path: Annotated[Path, typer.Argument(help="Folder inside the project to track with DVC.")],
) -> None:
    """Version a data set with DVC (dvc add + push to the configured remote); prints its md5."""
    from tasks.versioning import version as run

    out.print(run(path))
    _print_commit_hint([path], f"Version {path}")


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
    from tasks.build_model import build_model

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
    from tasks.build_model import build_model

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
    """Any DenseNet or ResNet by name, from params.yaml's `model` section and the options."""
    from tasks.build_model import build_model

    base = _config(config).model.model_dump() if config is not None else {}
    spec = build_model({**base, **_given(options)}, dest)
    out.print(f"wrote {spec.arch} to {dest}")


def _config(path: Path) -> PipelineConfig:
    """The params.yaml-shaped file at ``path``, checked in full (imported late: it is heavy)."""
    from flows.config import PipelineConfig

    return PipelineConfig.from_yaml(path)


@transform_app.command("init")
@_options_from(TransformSpec)
def transform_init(
    dest: Annotated[
        Path, typer.Argument(help="TransformationDirectory to write (transform.json).")
    ],
    config: Annotated[
        Path | None,
        typer.Option(
            help="params.yaml-shaped file: start from its `transform` section instead of the "
            "Azure design's defaults."
        ),
    ] = None,
    **options: Any,
) -> None:
    """Init Image Transformation: save a transform spec (the Azure design's defaults, changed by the
    options given)."""
    from tasks.errors import InvalidTransformationDirectoryError
    from tasks.transform import init_transformation, input_size, read_transformation

    base = _config(config).transform.model_dump() if config is not None else {}
    init_transformation(dest, {**base, **_given(options)})
    try:
        size = input_size(read_transformation(dest))
        out.print(f"wrote {dest} (the network sees {size}x{size} images)")
    except InvalidTransformationDirectoryError as exc:  # fine for Apply, not for training
        out.print(f"wrote {dest}; not usable for training: {exc}")


@transform_app.command("apply")
def transform_apply(
    transform: Annotated[Path, typer.Argument(help="TransformationDirectory (transform init).")],
    images: Annotated[Path, typer.Argument(help="ImageDirectory to transform.")],
    dest: Annotated[Path, typer.Argument(help="ImageDirectory to write (PNG, same classes).")],
    mode: Annotated[
        str,
        typer.Option(
            help="inference: deterministic steps only (every random transform dropped); "
            "training: the random steps too."
        ),
    ] = "inference",
    seed: Annotated[
        int, typer.Option(help="Random seed of the training mode: same seed, same images.")
    ] = 1,
) -> None:
    """Apply Image Transformation: write the transformed images as a new ImageDirectory."""
    from tasks.imageformat import visible_name
    from tasks.transform import apply_transformation

    manifest = apply_transformation(transform, images, dest, mode=mode, seed=seed)  # type: ignore[arg-type]
    sizes = sorted({(e.width, e.height) for e in manifest.images})
    shown = ", ".join(f"{w}x{h}" for w, h in sizes[:5]) + (" ..." if len(sizes) > 5 else "")
    out.print(
        escape(f"{dest}: {len(manifest.images)} images ({shown}), {len(manifest.skipped)} skipped")
    )
    for item in manifest.skipped[:20]:
        out.print(escape(visible_name(f"  skipped {item.path}: {item.reason}")))


# How one `imageops train` joins a multi-node job: options of its own, beside TrainParams'.
_NODE_OPTIONS = (
    _option(
        "node_rank",
        None,
        int | None,
        typer.Option(
            help="Run only this node's agent (0 to nodes-1), one per machine; needs --run-id "
            "and --rdzv-endpoint. Without it, --nodes N runs all N agents on this machine."
        ),
    ),
    _option(
        "run_id",
        None,
        str | None,
        typer.Option(help="MLflow run of a multi-node job (print it with --open-run)."),
    ),
    _option(
        "rdzv_endpoint",
        None,
        str | None,
        typer.Option(
            help="host:port where the nodes meet (c10d rendezvous), the same on every node. "
            "Default for agents on this machine: 127.0.0.1 and a free port."
        ),
    ),
    _option(
        "rdzv_timeout",
        600,
        int,
        typer.Option(help="Seconds a node waits at the rendezvous for the others."),
    ),
    _option(
        "open_run",
        False,
        bool,
        typer.Option(
            "--open-run",
            help="Check everything, open the job's MLflow run (or find its unfinished one), "
            "print the run id and exit: the id every --node-rank agent needs.",
        ),
    ),
)


@app.command()
@_options_from(TrainParams)
@_with_options(*_NODE_OPTIONS)
def train(
    model: Annotated[Path, typer.Argument(help="UntrainedModelDirectory (imageops model ...).")],
    train_data: Annotated[Path, typer.Argument(help="Labeled training ImageDirectory.")],
    val_data: Annotated[Path, typer.Argument(help="Labeled validation ImageDirectory.")],
    dest: Annotated[Path, typer.Argument(help="ModelDirectory to write (the best epoch).")],
    config: Annotated[
        Path | None,
        typer.Option(
            help="params.yaml-shaped file: start from its `train` section (the options given "
            "replace its values). Without it: the Azure component's defaults."
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
    """Train PyTorch Model through torchrun (DDP); metrics and logs go to MLflow.

    One node trains here. --nodes N alone runs the train flow with N node agents on this
    machine; on N machines, run --open-run once, then one --node-rank agent on each machine.
    """
    from tasks.train import launch
    from tasks.train.request import TrainRequest

    node = {p.name: options.pop(p.name) for p in _NODE_OPTIONS}
    base = _config(config).train.model_dump() if config is not None else {}
    request = TrainRequest.checked(
        model=model, train_data=train_data, val_data=val_data, out=dest, transform=transform,
        params={**base, **_given(options)}, run_id=node["run_id"],
        node_rank=node["node_rank"] or 0, rdzv_endpoint=node["rdzv_endpoint"],
        rdzv_timeout_s=node["rdzv_timeout"],
    )  # fmt: skip
    out.print(_transform_note(transform, train_data, val_data))
    if node["open_run"]:
        out.print(launch.open_run(request))
        return
    if request.params.nodes > 1 and node["node_rank"] is None:
        if request.run_id is not None:
            from tasks.errors import InvalidParameterError

            raise InvalidParameterError(
                "--run-id names the run of one node agent's job; --nodes without --node-rank "
                "runs every agent here and opens the run itself.",
                "Add --node-rank (one agent per machine), or leave out --run-id.",
            )
        from flows.train import train_flow

        result = train_flow(request)
    else:
        result = launch.train(request)
    out.print(f"model: {result.model_dir}  MLflow run: {result.run_id}  metrics: {result.metrics}")


def _transform_note(transform: Path | None, *data: Path) -> str:
    """Which transform the run takes, in words: a user must never train at a size by surprise."""
    from tasks.transform import applied_to, input_size, read_transformation

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


@app.command()
def export(
    model_dir: Annotated[Path, typer.Argument(help="Trained ModelDirectory.")],
    sample: Annotated[
        Path | None, typer.Option(help="ImageDirectory whose images check ONNX against PyTorch.")
    ] = None,
) -> None:
    """Export to ONNX (dynamic batch) and check it against PyTorch."""
    from tasks.export import export_onnx

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
    from tasks.quantize import quantize as run

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


@app.command()
def register(
    model_dir: Annotated[Path, typer.Argument(help="Exported ModelDirectory.")],
    alias: Annotated[str | None, typer.Option(help="Alias to point at the new version.")] = None,
    name: Annotated[
        str | None,
        typer.Option(
            help="Registered model name. Default: IMAGEOPS_REGISTERED_MODEL_NAME, else "
            "imageops-classifier."
        ),
    ] = None,
) -> None:
    """Register the model's ONNX export as a new MLflow model version."""
    from tasks.registry import register as run

    registered = run(model_dir, alias=alias, settings=_with_model_name(name))
    out.print(f"registered {registered.name} version {registered.version}")


def _with_model_name(name: str | None) -> Settings:
    """The settings, with the registered model name a command was given."""
    settings = get_settings()
    return settings.model_copy(update={"registered_model_name": name}) if name else settings


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
    train_data: Annotated[Path, typer.Option(help="Labeled training ImageDirectory.")] = Path(
        "data/digits/train"
    ),
    val_data: Annotated[
        Path,
        typer.Option(help="Labeled validation ImageDirectory (the metric is measured on it)."),
    ] = Path("data/digits/val"),
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
    from tasks.transform import input_size, read_transformation

    study_spec = tune_spec_file(spec, **replaced)
    given = read_transformation(transform) if transform is not None else None
    chosen = study_transform(given, train_data, val_data)
    side = input_size(chosen)
    source = transform or ("the data's" if chosen != DEMO_TRANSFORM else "the demo's")
    out.print(escape(f"transform: {source} (the network sees {side}x{side} images)"))
    api_ready()
    result = tune_flow(
        study_spec,
        str(train_data.resolve()),
        str(val_data.resolve()),
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


@app.command()
def score(
    model: Annotated[
        str,
        typer.Argument(
            help="Exported ModelDirectory, or a registry URI: models:/<name>@<alias> or "
            "models:/<name>/<version> (downloaded into the local cache)."
        ),
    ],
    images: Annotated[Path, typer.Argument(help="ImageDirectory or any folder of images.")],
    dest: Annotated[Path, typer.Argument(help="Scored table to write (.csv or .parquet).")],
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
) -> None:
    """Score Image Model with ONNX Runtime, in batches; unreadable images become reported rows."""
    from tasks.model_uri import resolve_model
    from tasks.score import score_in_shards

    written = score_in_shards(
        resolve_model(model),
        images,
        dest,
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
            "evaluated side by side; logged as eval/compare/<metric>."
        ),
    ] = None,
    run_id: Annotated[
        str | None, typer.Option(help="MLflow run to log into (default: a new run).")
    ] = None,
) -> None:
    """Evaluate Model: accuracy, top-5, macro and weighted precision/recall/F1, confusion matrix."""
    from tasks.evaluate import evaluate as run

    result = run(scored, compare=compare, run_id=run_id)
    if result.compared is None:
        for key, value in result.metrics.items():
            out.print(f"{key}: {value:.4f}")
        return
    out.print(f"{'metric':<20} {scored.name:>14} {compare.name:>14}")
    for key, value in result.metrics.items():
        out.print(f"{key:<20} {value:>14.4f} {result.compared[key]:>14.4f}")


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
    name: Annotated[
        str | None,
        typer.Option(
            help="Registered model name. Default: IMAGEOPS_REGISTERED_MODEL_NAME, else "
            "imageops-classifier."
        ),
    ] = None,
) -> None:
    """Give the candidate the champion alias if it beats the champion on the holdout (via ONNX)."""
    from tasks.promote import promote as run

    decision = run(
        holdout, candidate=candidate, metric=metric, margin=margin, settings=_with_model_name(name)
    )
    verdict = "is now @champion" if decision.promoted else "stays where it is"
    out.print(f"{decision.name} v{decision.challenger_version} {verdict}: {decision.reason}")


@serve_app.callback(invoke_without_command=True)
def serve_stack(
    ctx: typer.Context,
    host: Annotated[
        str,
        typer.Option(
            help="Interface the servers listen on. 127.0.0.1: this machine only; 0.0.0.0: "
            "every interface (put it behind a firewall or proxy: the servers have no login)."
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
    from flows.stack import Ports, Stack

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
        out.print(f"[bold]Prefect UI[/]  {stack.prefect_url}")
        out.print(f"[bold]MLflow UI[/]   {stack.mlflow_url}")
        out.print(f"[bold]Receiver[/]    {stack.receiver_url}")
        out.print(f"[bold]Worker[/]      {'pool `local`' if worker else 'none'}")
        out.print(f"[bold]Logs[/]        {stack.dir / 'logs'}")
        out.print("Use this stack from another shell:")
        out.print(f"  export IMAGEOPS_PREFECT_API_URL={stack.prefect_api}")
        out.print(f"  export IMAGEOPS_MLFLOW_TRACKING_URI={stack.mlflow_url}")
        out.print("[bold]ready[/]; Ctrl-C stops everything")
        stack.serve_forever()
    except KeyboardInterrupt:
        err.print("stopping ...")
    finally:
        stack.stop()
    err.print("stopped")


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
    from flows.webhook import serve

    serve(host=host, port=port)


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
    from flows.webhook import register_webhook as run

    out.print(f"webhook {run(receiver_url, mlflow_url=mlflow_url, test=test)} is active")


@app.command("run")
def run_pipeline(
    source: Annotated[
        Path | None,
        typer.Argument(
            help="Raw images (folder or archive). Default: data/raw/digits (the digits)."
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
    epochs: Annotated[int | None, typer.Option(help="Override the training epochs.")] = None,
    nproc_per_node: Annotated[
        int | None, typer.Option(help="Override the training processes.")
    ] = None,
) -> None:
    """Run the whole pipeline as a Prefect flow and print where to look."""
    settings = get_settings()
    if source is not None and not source.exists():  # before anything starts: seconds saved
        from tasks.errors import NoUsableImagesError

        raise NoUsableImagesError(
            f"{source} does not exist.",
            "Pass a folder of images (one sub-folder per class), an archive of one, or a CSV / "
            "COCO label file; with no SOURCE, imageops run uses the digits sample.",
        )
    from flows.config import PipelineConfig

    cfg = PipelineConfig.from_yaml(config) if config else PipelineConfig()
    if source is None and not (settings.project_root / cfg.source).exists():
        from tasks.sample import write_digits

        out.print(f"{cfg.source} is missing: writing the digits sample there first")
        write_digits(settings.project_root / cfg.source)
    updates: dict = {}
    if source is not None:
        updates["source"] = str(source.resolve())
    if dataset is not None:
        updates["dataset"] = dataset
    train_updates = {
        k: v for k, v in {"epochs": epochs, "nproc_per_node": nproc_per_node}.items() if v
    }
    if train_updates:
        updates["train"] = cfg.train.model_copy(update=train_updates)
    cfg = PipelineConfig.checked(
        {**cfg.model_dump(), **updates},
        "imageops run",
        "Fix the option; `imageops run --help` lists every one.",
    )

    cfg.check_sources(settings)  # a refused run starts nothing and leaves nothing behind
    # The temporary API comes up while the flow's libraries import.
    api_ready = _start_prefect_api(settings)
    from flows.pipeline import pipeline

    api_ready()
    result = pipeline(cfg)
    _print_summary(settings, result)
    if result.data_version:
        data = settings.data_path / result.dataset
        parts = [data / part for part in result.data_version]
        _print_commit_hint(parts, f"Data set {result.dataset}")


def _start_prefect_api(settings: Settings) -> Callable[[], object]:
    """Start the temporary Prefect API before the flow's imports; ``wait()`` before the flow."""
    from flows.temporary_api import start_temporary_api

    api = start_temporary_api(settings.home_dir / "prefect" / "temporary-api.log")
    return api.wait if api else lambda: None


def _print_commit_hint(versioned: list[Path], message: str) -> None:
    """Name the DVC files git has not committed yet, and the command that commits them.

    A data version is recorded by its ``.dvc`` file in a commit: ``dvc exp run``, ``dvc checkout``
    at another commit and other checkouts see only what is committed.
    """
    from tasks.versioning import uncommitted

    files = uncommitted(versioned)
    if not files:
        return
    names = " ".join(shlex.quote(f) for f in files)
    out.print(
        "commit the data versions to git (DVC experiments and checkouts see only committed ones):"
    )
    out.print(escape(f"  git add {names} && git commit -m {shlex.quote(message)}"))


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
    versions = Table("data set", "DVC md5", title="data versions", title_justify="left")
    for name, md5 in result.data_version.items():
        versions.add_row(name, md5)
    if result.data_version:
        out.print(versions)
    mlflow_bin = Path(sys.executable).parent / "mlflow"
    out.print(
        f"  look at it: {mlflow_bin} ui --backend-store-uri {redact_uri(settings.tracking_uri)} "
        f"--default-artifact-root {settings.artifact_location}"
    )


def main() -> None:
    """Console entry: user errors print what was wrong and what to do, never a traceback."""
    try:
        app()
    except ImageOpsError as exc:
        # The error's name first (the Azure docs know errors by it); messages may quote a
        # settings URI or a library's error that echoes one: passwords masked, markup escaped.
        problem, hint = error_summary(exc)
        err.print(f"[bold red]error:[/] {escape(problem)}")
        if hint:
            err.print(f"[yellow]what to do:[/] {escape(hint)}")
        sys.exit(2)


if __name__ == "__main__":
    main()
