"""Register a model: the exported ONNX model becomes a version in the MLflow model registry.

The model is logged with MLflow's ONNX flavor (so ``mlflow.onnx.load_model`` and ``mlflow.pyfunc``
load it by ``models:/<name>@<alias>``) into the run that trained it, with the ModelDirectory files
beside it, and the version is tagged with what it was made from: data md5s, git revision, training
parameters and final metrics. Scoring never needs a pickled flavor: the registry holds ONNX.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import mlflow
import mlflow.onnx
import numpy as np
import onnx
from mlflow.models import ModelSignature
from mlflow.tracking import MlflowClient
from mlflow.types import Schema, TensorSpec
from PIL import Image

from models.directory import ONNX, WEIGHTS, ModelInfo, read_model_info
from models.untrained import MODEL_JSON
from tasks.errors import InvalidParameterError, RegistryError
from tasks.export import META_WEIGHTS_SHA256, sha256_file
from tasks.settings import Settings, get_settings, redact_uri
from tasks.step import step, step_logger
from tasks.tracking import mlflow_run
from tasks.transform import build_transform, input_size
from tasks.versioning import git_revision

ARTIFACT_NAME = "model"
DIRECTORY_ARTIFACTS = "model_directory"
MAX_TAG_VALUE = 5000  # a readable tag; a long class list is in the MLmodel metadata anyway
# MLflow's alias rule: word characters and dashes; "latest" and "v<number>" are reserved.
_ALIAS = re.compile(r"^[\w\-]{1,255}$")
_RESERVED_ALIAS = re.compile(r"^(latest|v\d+)$", re.IGNORECASE)


@dataclass(frozen=True)
class RegisteredModel:
    """A model version in the registry, and where to load it from."""

    name: str
    version: int
    run_id: str
    model_uri: str  # models:/<name>/<version>
    alias: str | None = None


def signature_for(info: ModelInfo) -> tuple[ModelSignature, np.ndarray]:
    """Tensor signature and input example, shaped by the model's own transform spec.

    The example is a neutral grey image put through the inference transform, so its shape, dtype
    and value range are exactly what the scorer feeds the model.
    """
    side = input_size(info.transform)
    signature = ModelSignature(
        inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, 3, side, side), "input")]),
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, len(info.classes)), "logits")]),
    )
    grey = Image.new("RGB", (side, side), (128, 128, 128))
    example = build_transform(info.transform, "inference")(grey).numpy()[None].astype(np.float32)
    return signature, example


def check_alias(alias: str) -> None:
    """Refuse an alias MLflow would refuse, before anything is logged or registered."""
    if not _ALIAS.match(alias) or _RESERVED_ALIAS.match(alias):
        raise InvalidParameterError(
            f"alias {alias!r} is not a valid MLflow alias.",
            "Use letters, digits, '_' and '-' (1-255 characters); 'latest' and 'v<number>' are "
            "reserved.",
        )


def _version_tags(
    info: ModelInfo, data_version: dict[str, str], revision: str, onnx_sha: str
) -> dict[str, str]:
    tags = {
        "architecture": info.architecture.arch,
        "num_classes": str(len(info.classes)),
        "git_revision": revision,
        "onnx_sha256": onnx_sha,
    }
    classes = json.dumps(info.classes)
    if len(classes) <= MAX_TAG_VALUE:
        tags["classes"] = classes
    tags |= {f"data_md5.{name}": str(md5) for name, md5 in data_version.items()}
    tags |= {f"param.{key}": str(value) for key, value in info.train_params.items()}
    tags |= {f"metric.{key}": repr(float(value)) for key, value in info.metrics.items()}
    return tags


def register(
    model_dir: Path,
    *,
    settings: Settings | None = None,
    data_version: dict[str, str] | None = None,
    alias: str | None = None,
) -> RegisteredModel:
    """Log ``model_dir``'s ONNX model to MLflow and register it as a new version.

    The model goes into its training run (``model.json``'s ``mlflow_run_id``), or a new run when
    it has none. ``data_version`` (name -> md5) defaults to the one in ``model.json``. ``alias``,
    when given, is moved to the new version. Raises RegistryError when ``model.onnx`` is missing
    or was exported from other weights (run the export step first).
    """
    settings = settings or get_settings()
    model_dir = Path(model_dir)
    if alias is not None:
        check_alias(alias)
    info = read_model_info(model_dir)
    onnx_path = model_dir / ONNX
    if not onnx_path.is_file():
        raise RegistryError(
            f"{model_dir} has no {ONNX}: there is nothing to register.",
            f"Run `imageops export {model_dir}` first, so the registry gets a parity-checked "
            "ONNX model.",
        )
    onnx_model = onnx.load(str(onnx_path))
    exported_from = {p.key: p.value for p in onnx_model.metadata_props}.get(META_WEIGHTS_SHA256)
    if exported_from is not None and exported_from != sha256_file(model_dir / WEIGHTS):
        raise RegistryError(
            f"{onnx_path} was exported from other weights than {model_dir / WEIGHTS}.",
            f"Run `imageops export {model_dir}` again; registering would publish a stale model.",
        )
    data_version = dict(info.data_version if data_version is None else data_version)
    tags = _version_tags(
        info, data_version, git_revision(settings.project_root), sha256_file(onnx_path)
    )
    signature, example = signature_for(info)
    log = step_logger(__name__)

    run_name = None if info.mlflow_run_id else f"register-{info.architecture.arch}"
    with mlflow_run(settings, info.mlflow_run_id, run_name=run_name) as run_id:
        logged = mlflow.onnx.log_model(
            onnx_model,
            name=ARTIFACT_NAME,
            signature=signature,
            input_example=example,
            # One file, as export wrote it; MLflow's default splits the weights out.
            save_as_external_data=False,
            # An ONNX model needs exactly onnx + onnxruntime (MLflow adds itself). Naming them
            # skips MLflow's inference, which re-imports the model in a subprocess (~4 s).
            pip_requirements=mlflow.onnx.get_default_pip_requirements(),
            metadata={"classes": info.classes, "transform": info.transform.model_dump()},
        )
        for name in (MODEL_JSON, WEIGHTS):
            mlflow.log_artifact(str(model_dir / name), artifact_path=DIRECTORY_ARTIFACTS)
        try:
            version = mlflow.register_model(
                logged.model_uri, settings.registered_model_name, tags=tags
            )
        except mlflow.exceptions.MlflowException as exc:
            raise RegistryError(
                f"Could not register {settings.registered_model_name!r} in "
                f"{redact_uri(settings.registry_uri)}: {redact_uri(exc.message)}",
                "Check the registry URI and that it is writable.",
            ) from None  # MLflow's error may hold the URI with its password
    if alias is not None:
        MlflowClient().set_registered_model_alias(
            settings.registered_model_name, alias, version.version
        )
    log.info(
        "Registered %s version %s%s",
        settings.registered_model_name,
        version.version,
        f" as @{alias}" if alias else "",
    )
    return RegisteredModel(
        name=settings.registered_model_name,
        version=int(version.version),
        run_id=run_id,
        model_uri=f"models:/{settings.registered_model_name}/{version.version}",
        alias=alias,
    )


register_task = step(register, name="register-model")
