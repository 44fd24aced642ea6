"""The ``imageops`` Typer app and its sub-apps, the options generated from the request models, and
the console entry: a user error prints what was wrong and what to do, never a traceback.
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

from app.cli.help_layout import HelpTyper
from models.errors import ImageOpsError, disk_full
from tasks.shared.errors import error_summary
from tasks.shared.settings import Settings, get_settings

if TYPE_CHECKING:
    from flows.config import PipelineConfig
    from tasks.data.data_refs import ResolvedData


app = HelpTyper(
    name="imageops",
    help="Image classification MLOps: convert, version, split, train (DDP), tune, export, "
    "register, promote, score, evaluate. Locations come from IMAGEOPS_* environment variables "
    "(see docs/configuration.md).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
sample_app = HelpTyper(help="Write real sample data sets.", no_args_is_help=True)
model_app = HelpTyper(help="Write an UntrainedModelDirectory (DenseNet, ResNet).")
transform_app = HelpTyper(
    help="Init / Apply Image Transformation: save a transform spec, apply it to images.",
    no_args_is_help=True,
)
serve_app = HelpTyper(
    help="Serve: with no subcommand, the whole local stack (Prefect server and worker, MLflow "
    "server, promotion receiver, every deployment) until Ctrl-C; `scoring` and `webhook` serve "
    "one part for a Prefect server you run yourself.",
)
cluster_app = HelpTyper(
    help="The Ray cluster multi-node training runs on: its Kubernetes (KubeRay) manifest.",
    no_args_is_help=True,
)
app.add_typer(serve_app, name="serve")
app.add_typer(sample_app, name="sample")
app.add_typer(model_app, name="model")
app.add_typer(transform_app, name="transform")
app.add_typer(cluster_app, name="cluster")


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


def _config(path: Path) -> PipelineConfig:
    """The params.yaml-shaped file at ``path``, checked in full (imported late: it is heavy)."""
    from flows.config import PipelineConfig

    return PipelineConfig.from_yaml(path)


def _start_prefect_api(settings: Settings) -> Callable[[], object]:
    """Start the temporary Prefect API before the flow's imports; ``wait()`` before the flow."""
    from app.temporary_api import start_temporary_api

    api = start_temporary_api(settings.home_dir / "prefect" / "temporary-api.log")
    return api.wait if api else lambda: None


def _data_argument(data: str, what: str) -> ResolvedData:
    """A data argument as a folder here: a path from the working folder, or a data set version
    (NAME@VERSION, :mod:`tasks.data.data_refs`).

    The command line's paths are the shell's (from where the user stands); the resolver takes
    a relative path from the project root, so it gets an existing one absolute.
    """
    from tasks.data.data_refs import resolve_data

    given = Path(data).expanduser()
    return resolve_data(given.resolve() if given.exists() else data, what)


def _print_commit_hint(versioned: list[Path], message: str) -> None:
    """Name the DVC files git has not committed yet, and the command that commits them.

    A data version is recorded by its ``.dvc`` file in a commit: ``dvc exp run``, ``dvc checkout``
    at another commit and other checkouts see only what is committed.
    """
    from tasks.data.versioning import uncommitted

    files = uncommitted(versioned)
    if not files:
        return
    names = " ".join(shlex.quote(f) for f in files)
    out.print(
        "commit the data versions to git (DVC experiments and checkouts see only committed ones):"
    )
    out.print(escape(f"  git add {names} && git commit -m {shlex.quote(message)}"))


def main() -> None:
    """Console entry: user errors print what was wrong and what to do, never a traceback."""
    try:
        app()
    except ImageOpsError as exc:
        _exit_with(exc)
    except Exception as exc:
        full = disk_full(exc)  # a full disk is the user's to fix, not a bug: no traceback
        if full is None:
            raise
        _exit_with(full)


def _exit_with(exc: ImageOpsError) -> None:
    # The error's name first (the Azure docs know errors by it); messages may quote a settings
    # URI or a library's error that echoes one: passwords masked, markup escaped.
    problem, hint = error_summary(exc)
    err.print(f"[bold red]error:[/] {escape(problem)}")
    if hint:
        err.print(f"[yellow]what to do:[/] {escape(hint)}")
    sys.exit(2)
