"""The trained ModelDirectory: ``model.json``, ``model.safetensors``, ``model.onnx`` once exported.

``model.int8.onnx`` (and ``model.int8.json``, how it was calibrated and how much top-1 it costs)
appear once the quantize step has accepted a static INT8 version of ``model.onnx``.

Everything needed to rebuild, score or audit the model sits in ``model.json`` as plain JSON; the
weights are safetensors, so loading a model directory can never run code. torch is imported only
to load or save the weights: reading ``model.json`` (scoring's ONNX path, promotion, evaluate)
does not pay for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from models.atomic import atomic_directory, write_json
from models.errors import InvalidModelDirectoryError
from models.transform_spec import TransformSpec
from models.untrained import MODEL_JSON, ModelSpec

if TYPE_CHECKING:
    from torch import nn

WEIGHTS = "model.safetensors"
ONNX = "model.onnx"
ONNX_INT8 = "model.int8.onnx"
INT8_REPORT = "model.int8.json"
TRAINED_FORMAT = "imageops.ModelDirectory"


class ModelInfo(BaseModel):
    """``model.json`` of a trained ModelDirectory."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["imageops.ModelDirectory"] = TRAINED_FORMAT
    format_version: int = 1
    architecture: ModelSpec
    classes: list[str]
    # The transform the model was trained with; scoring and export build its inference mode.
    transform: TransformSpec
    train_params: dict[str, Any] = Field(default_factory=dict)
    # Counts as int; None where a value was not a finite number (JSON has no NaN).
    metrics: dict[str, int | float | None] = Field(default_factory=dict)
    data_version: dict[str, str] = Field(default_factory=dict)
    mlflow_run_id: str | None = None
    best_epoch: int | None = None


def save_model_directory(dest: Path, model: nn.Module, info: ModelInfo) -> Path:
    """Write weights and ``model.json`` to ``dest`` atomically (a half model never looks whole)."""
    from safetensors.torch import save_file

    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    with atomic_directory(Path(dest), replaces=MODEL_JSON) as tmp:
        save_file(state, str(tmp / WEIGHTS))
        write_json(tmp / MODEL_JSON, info.model_dump(mode="json"))
    return Path(dest)


def read_model_info(path: Path) -> ModelInfo:
    path = Path(path)
    hint = "Pass the folder `imageops train` wrote (it holds model.json and model.safetensors)."
    if not (path / MODEL_JSON).is_file():
        raise InvalidModelDirectoryError(f"{path} is not a model directory: no {MODEL_JSON}.", hint)
    try:
        return ModelInfo.model_validate_json((path / MODEL_JSON).read_bytes())
    except ValidationError as exc:
        raise InvalidModelDirectoryError(
            f"{path / MODEL_JSON} is not a trained model directory "
            f"({exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}).",
            hint,
        ) from exc


def load_model_directory(path: Path) -> tuple[nn.Module, ModelInfo]:
    """Rebuild the network from ``model.json`` and load its safetensors weights (eval mode)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from models.zoo import build_model

    path = Path(path)
    info = read_model_info(path)
    if not (path / WEIGHTS).is_file():
        raise InvalidModelDirectoryError(
            f"{path} has no {WEIGHTS}.", "Train the model again; the directory is incomplete."
        )
    # The trained weights replace any pretrained ones, so never read those here; the network is
    # built as it was trained (pretrained weights fix options of some, e.g. Inception's).
    model = build_model(
        info.architecture,
        num_classes=len(info.classes),
        input_size=info.transform.input_side(),
        load_weights=False,
    )
    try:
        model.load_state_dict(load_file(str(path / WEIGHTS)))
    except (SafetensorError, RuntimeError) as exc:  # not safetensors (a pickle?), or another net
        raise InvalidModelDirectoryError(
            f"{path / WEIGHTS} does not hold the weights model.json describes: "
            f"{str(exc).splitlines()[0]}",
            "Pass the folder `imageops train` wrote, unchanged; weights are only read as "
            "safetensors, never unpickled.",
        ) from exc
    return model.eval(), info
