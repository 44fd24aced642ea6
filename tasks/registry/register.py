"""Register a model: the exported ONNX model becomes a version in the MLflow model registry.

The version is a pyfunc model (models/image_pyfunc.py, logged as code: nothing pickled) that
takes images as they come and returns labels and probabilities, so consumers need neither
imageops nor torch. It is logged into the run that trained it, tagged with what it was made from
and described. Details: docs/promotion.md#registration.

A register killed at any point (SIGKILL skips every ``finally``) leaves true states: the training
run is written to with the client and never reopened, so it keeps its FINISHED; the same command
again finds what the killed one made (the logged model, the version still tagged incomplete) by
the registration's key and completes it, instead of adding a second version or leaving a PENDING
logged model behind.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import version as installed_version
from pathlib import Path

import mlflow
import mlflow.pyfunc
import onnx
import pandas as pd
from mlflow.entities import LoggedModelStatus
from mlflow.models import Model, ModelSignature
from mlflow.tracking import MlflowClient
from mlflow.types import ColSpec, DataType, Schema
from PIL import Image

import models
from models.atomic import scratch_folder
from models.directory import ONNX, WEIGHTS, ModelInfo, read_model_info
from models.errors import ImageOpsError
from models.untrained import MODEL_JSON
from tasks.data.git_revision import git_revision
from tasks.data.transform import inference_steps
from tasks.inference.export import META_WEIGHTS_SHA256, sha256_file
from tasks.inference.score import LABEL_COLUMN, PROBABILITY_PREFIX
from tasks.registry.champion_record import BY_REGISTER, CHAMPION_ALIAS, mark_pending, reconcile
from tasks.registry.version_description import IMAGE_COLUMN, describe_version
from tasks.registry.version_scores import Holdout, identify, labeled_holdout, version_metrics
from tasks.shared import faults
from tasks.shared.artifacts import for_people
from tasks.shared.errors import InvalidParameterError, RegistryError
from tasks.shared.project_lock import taking_turns
from tasks.shared.settings import Settings, get_settings, redact_uri
from tasks.shared.step import step, step_logger, tasks_on_first_use
from tasks.shared.tracking import configure_mlflow

ARTIFACT_NAME = "model"
DIRECTORY_ARTIFACTS = "model_directory"
# The pyfunc model's code, logged with every version (models from code) and run where it loads.
PYFUNC_CODE = Path(models.__file__).with_name("image_pyfunc.py")
ONNX_ARTIFACT = "onnx_model"  # its key in the pyfunc's artifacts: artifacts/model.onnx
# What the pyfunc imports, pinned to the versions it was logged with (MLflow adds itself).
# Naming them skips MLflow's requirement inference, which loads the model in a subprocess.
PYFUNC_REQUIREMENTS = ("onnxruntime", "numpy", "pandas", "pillow")
MAX_TAG_VALUE = 5000  # a readable tag; a long class list is in the MLmodel metadata anyway
DATA_REF_TAG = "data_ref."  # + the data set's part (train, val, ...): its reference, name@md5
# MLflow's alias rule: word characters and dashes; "latest" and "v<number>" are reserved.
_ALIAS = re.compile(r"^[\w\-]{1,255}$")
_RESERVED_ALIAS = re.compile(r"^(latest|v\d+)$", re.IGNORECASE)
# Which registration made a logged model (and a run of register's own): the key of
# :func:`registration_key`. A version carries it in INCOMPLETE_TAG until its last step is done.
REGISTRATION_TAG = "imageops.registration"
INCOMPLETE_TAG = "imageops.registration.incomplete"
LOCK_TIMEOUT_S = 600.0  # the same model being registered by another command: minutes at most
# The version's top-1 tags: the exported model's on the validation set, scored as `imageops
# evaluate` scores it (only when register was given that set), and training's own figure.
TOP1_TAG = "val_top1"
TRAINING_TOP1_TAG = "training_val_top1"


@dataclass(frozen=True)
class RegisteredModel:
    """A model version in the registry, and where to load it from."""

    name: str
    version: int
    run_id: str
    model_uri: str  # models:/<name>/<version>
    alias: str | None = None


def signature_for(info: ModelInfo) -> tuple[ModelSignature, pd.DataFrame]:
    """The pyfunc's signature and input example: an ``image`` column in, the score columns out.

    The example is two grey PNG files of different sizes (any size is taken), as bytes; MLflow
    stores it base64-encoded, which is the REST request's format for binary columns.
    """
    side = inference_steps(info.transform)["input_size"]
    signature = ModelSignature(
        inputs=Schema([ColSpec(DataType.binary, IMAGE_COLUMN)]),
        outputs=Schema(
            [
                *(ColSpec(DataType.double, f"{PROBABILITY_PREFIX}{c}") for c in info.classes),
                ColSpec(DataType.string, LABEL_COLUMN),
            ]
        ),
    )
    images = []
    for size in ((side, side), (2 * side, side + 3)):
        buffer = io.BytesIO()
        Image.new("RGB", size, (128, 128, 128)).save(buffer, format="PNG")
        images.append(buffer.getvalue())
    return signature, pd.DataFrame({IMAGE_COLUMN: images})


def model_config(info: ModelInfo) -> dict[str, object]:
    """What the pyfunc needs besides the ONNX file: class names and the inference steps."""
    return {"classes": list(info.classes), **inference_steps(info.transform)}


def check_alias(alias: str) -> None:
    """Refuse an alias MLflow would refuse, before anything is logged or registered."""
    if not _ALIAS.match(alias) or _RESERVED_ALIAS.match(alias):
        raise InvalidParameterError(
            f"alias {alias!r} is not a valid MLflow alias.",
            "Use letters, digits, '_' and '-' (1-255 characters); 'latest' and 'v<number>' are "
            "reserved.",
        )


def _version_tags(
    info: ModelInfo,
    data_version: dict[str, str],
    revision: str,
    onnx_sha: str,
    data_refs: dict[str, str],
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
    # name@md5: what `--train-data` / `train_data=` takes on any machine sharing the DVC remote.
    tags |= {f"{DATA_REF_TAG}{name}": ref for name, ref in data_refs.items()}
    # What a person compares in the version list; every parameter and metric is in the
    # training run the version links to (and in model.json), not repeated here as 40 tags.
    if "recipe" in info.train_params:
        tags["recipe"] = str(info.train_params["recipe"])
    if info.metrics.get("val/top1") is not None:
        tags[TRAINING_TOP1_TAG] = f"{float(info.metrics['val/top1']):.4f}"
    return tags


def register(
    model_dir: Path,
    *,
    settings: Settings | None = None,
    data_version: dict[str, str] | None = None,
    alias: str | None = None,
    data_refs: dict[str, str] | None = None,
    validation: Path | None = None,
) -> RegisteredModel:
    """Log ``model_dir``'s ONNX model to MLflow and register it as a new version.

    ``validation``: the labeled ImageDirectory the model was validated on. The registered ONNX
    model is scored on it (ONNX Runtime, as `imageops score` and `imageops evaluate` do) and
    those figures become the version's (its ``val_top1`` tag and description, and the score
    record promotion reuses), so the registry shows what the model as published does; training's
    own figure (PyTorch) stays beside them, labelled. Without it, the version shows training's
    figure only, labelled as such.

    The model goes into its training run (``model.json``'s ``mlflow_run_id``), or a new run when
    it has none. ``data_version`` (name -> md5) defaults to the one in ``model.json``; ``data_refs``
    (name -> ``<data set>@<md5>``, :mod:`tasks.data.data_refs`) become ``data_ref.<name>`` tags, so
    the same data can be trained on again from any machine. ``alias``,
    when given, is moved to the new version. A version that a killed register of the same model
    (same run, same tags) left incomplete is completed instead of adding another. Raises
    RegistryError when ``model.onnx`` is missing or was exported from other weights (run the
    export step first).
    """
    settings = settings or get_settings()
    model_dir = Path(model_dir)
    if alias is not None:
        check_alias(alias)
    held = None
    if validation is not None:  # refused before anything is logged
        validation = Path(validation)
        held = identify(validation, labeled_holdout(validation, "validation data"))
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
        info,
        data_version,
        git_revision(settings.project_root),
        sha256_file(onnx_path),
        dict(data_refs or {}),
    )
    name = settings.registered_model_name
    key = registration_key(info.mlflow_run_id, name, tags)
    configure_mlflow(settings)
    client = MlflowClient()
    log = step_logger(__name__)
    with _one_registration_at_a_time(settings, key):
        version = _incomplete_version(client, name, key)
        own_run = info.mlflow_run_id is None
        if version is not None:  # a register of this model was killed after making it
            log.info("Completing version %s, which an earlier register left unfinished", version)
            run_id = client.get_model_version(name, str(version)).run_id
        elif own_run:
            run_id = _own_run(client, settings, key, f"register-{info.architecture.arch}")
        else:
            run_id = _training_run(client, settings, info.mlflow_run_id)
        try:
            if version is None:
                model_id = _logged_model(client, run_id, key, info, onnx_path)
                for file in (MODEL_JSON, WEIGHTS):
                    client.log_artifact(
                        run_id, str(model_dir / file), artifact_path=DIRECTORY_ARTIFACTS
                    )
                version = _new_version(settings, model_id, {**tags, INCOMPLETE_TAG: key})
            validated = None
            if held is not None:
                scores = _validation_scores(client, settings, info, version, model_dir, held)
                validated = held, scores
            _describe_and_alias(client, info, name, version, alias, validated)
            if own_run:
                client.set_terminated(run_id)
            # The last step: from here on the registration is done, and the same command
            # again registers a new version, as it does after any register that ended.
            client.delete_model_version_tag(name, str(version), INCOMPLETE_TAG)
        except Exception:
            if own_run:
                client.set_terminated(run_id, "FAILED")
            raise
    log.info("Registered %s version %s%s", name, version, f" as @{alias}" if alias else "")
    return RegisteredModel(
        name=name,
        version=version,
        run_id=run_id,
        model_uri=f"models:/{name}/{version}",
        alias=alias,
    )


def _validation_scores(
    client: MlflowClient,
    settings: Settings,
    info: ModelInfo,
    version: int,
    model_dir: Path,
    held: Holdout,
) -> dict[str, float]:
    """The Evaluate Model metrics of the version's ONNX model (``model_dir``'s, the file just
    registered) on ``held``, recorded on the version; its ``val_top1`` tag is their accuracy."""
    name = settings.registered_model_name
    dest = settings.home_dir / "registrations" / f"v{version}"
    with scratch_folder(dest, "scored") as work:
        metrics, _ = version_metrics(client, name, version, model_dir, held, work / "val.csv")
    client.set_model_version_tag(name, str(version), TOP1_TAG, f"{metrics['accuracy']:.4f}")
    step_logger(__name__).info(
        "%s v%s: top-1 %.4f on %s as exported and scored (training's own: %s)",
        name,
        version,
        metrics["accuracy"],
        held.path.name,
        for_people(info.metrics.get("val/top1")),
    )
    return metrics


def registration_key(run_id: str | None, name: str, tags: dict[str, str]) -> str:
    """What identifies one registration: the training run, the registered model and the version's
    tags (the ONNX file's hash, the data version, the git revision). A killed register and the
    same command again have the same key; the alias is not part of it (it only moves)."""
    text = json.dumps({"run": run_id, "name": name, "tags": tags}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _one_registration_at_a_time(settings: Settings, key: str) -> AbstractContextManager[None]:
    """Two registers of the same model at once would each take the other's half-made version or
    logged model for a killed one's: the second waits for the first."""
    return taking_turns(
        settings.home_dir / "locks" / f"register-{key[:16]}.lock",
        LOCK_TIMEOUT_S,
        RegistryError,
        "another register of this model",
        "Check for a stuck `imageops register` process (it holds the lock) and stop it, then "
        "register again.",
    )


def _incomplete_version(client: MlflowClient, name: str, key: str) -> int | None:
    """The version a killed register with this key created and did not finish, if any."""
    found = client.search_model_versions(f"name = '{name}' AND tags.`{INCOMPLETE_TAG}` = '{key}'")
    return min((int(v.version) for v in found), default=None)


def _training_run(client: MlflowClient, settings: Settings, run_id: str) -> str:
    """``run_id``, once it is known to exist. It is written to with the client, never made the
    active run: ``mlflow.start_run`` would set it RUNNING, and a kill would leave it so."""
    try:
        client.get_run(run_id)
    except mlflow.exceptions.MlflowException as exc:
        raise ImageOpsError(
            f"MLflow run {run_id} does not exist in {redact_uri(settings.tracking_uri)}.",
            "Train the model in this tracking store, or clear `mlflow_run_id` in its model.json.",
        ) from exc
    return run_id


def _own_run(client: MlflowClient, settings: Settings, key: str, run_name: str) -> str:
    """A run for a model no training run recorded: the one a killed register with this key left
    unfinished, else a new one (ended FINISHED once the version is complete)."""
    experiment_id = configure_mlflow(settings)
    unfinished = client.search_runs(
        [experiment_id],
        f"tags.`{REGISTRATION_TAG}` = '{key}' AND attributes.status != 'FINISHED'",
        max_results=1,
    )
    if unfinished:
        return unfinished[0].info.run_id
    run = client.create_run(experiment_id, run_name=run_name, tags={REGISTRATION_TAG: key})
    return run.info.run_id


def _logged_model(
    client: MlflowClient, run_id: str, key: str, info: ModelInfo, onnx_path: Path
) -> str:
    """The id of this registration's READY logged model in ``run_id``: the one a killed register
    finished, else a new one. One it left PENDING (or FAILED) is deleted: no half model stays."""
    run = client.get_run(run_id)
    experiment_id = run.info.experiment_id
    # A version's source is the URI it was registered from: models:/<logged model id>.
    registered = {v.source for v in client.search_model_versions(f"run_id = '{run_id}'")}
    left = client.search_logged_models(
        [experiment_id],
        filter_string=f"source_run_id = '{run_id}' AND tags.`{REGISTRATION_TAG}` = '{key}'",
    )
    ready = None
    for model in left:
        if f"models:/{model.model_id}" in registered:
            continue  # an earlier registration's, which ended
        if model.status == LoggedModelStatus.READY and ready is None:
            ready = model.model_id
        else:
            client.delete_logged_model(model.model_id)
    if ready is not None:
        return ready
    model = mlflow.initialize_logged_model(
        name=ARTIFACT_NAME,
        source_run_id=run_id,
        tags={REGISTRATION_TAG: key},
        params=dict(run.data.params),
        experiment_id=experiment_id,
    )
    faults.point("register.logged_model_created", model_id=model.model_id)
    signature, example = signature_for(info)
    # Model.log, not mlflow.pyfunc.log_model: it takes the run by id, with no active run.
    Model.log(
        artifact_path=None,  # deprecated by MLflow, yet a required argument
        name=ARTIFACT_NAME,
        flavor=mlflow.pyfunc,
        run_id=run_id,
        model_id=model.model_id,
        python_model=str(PYFUNC_CODE),
        artifacts={ONNX_ARTIFACT: str(onnx_path)},
        model_config=model_config(info),
        signature=signature,
        input_example=example,
        pip_requirements=[f"{p}=={installed_version(p)}" for p in PYFUNC_REQUIREMENTS],
        metadata={"classes": info.classes, "transform": info.transform.model_dump()},
    )
    faults.point("register.model_logged", model_id=model.model_id)
    return model.model_id


def _new_version(settings: Settings, model_id: str, tags: dict[str, str]) -> int:
    name = settings.registered_model_name
    try:
        version = mlflow.register_model(f"models:/{model_id}", name, tags=tags)
    except mlflow.exceptions.MlflowException as exc:
        raise RegistryError(
            f"Could not register {name!r} in {redact_uri(settings.registry_uri)}: "
            f"{redact_uri(exc.message)}",
            "Check the registry URI and that it is writable.",
        ) from None  # MLflow's error may hold the URI with its password
    faults.point("register.version_created", version=version.version)
    return int(version.version)


def _describe_and_alias(
    client: MlflowClient,
    info: ModelInfo,
    name: str,
    version: int,
    alias: str | None,
    validated: tuple[Holdout, dict[str, float]] | None = None,
) -> None:
    """The version's description and ``alias``: steps a killed register's rerun does again."""
    client.update_model_version(
        name, str(version), description=describe_version(info, name, version, validated)
    )
    faults.point("register.described", version=version)
    if alias is None:
        return
    if alias == CHAMPION_ALIAS:  # the champion tags say it was this command's move
        mark_pending(client, name, version, BY_REGISTER)
    client.set_registered_model_alias(name, alias, str(version))
    if alias == CHAMPION_ALIAS:
        reconcile(client, name, alias, moved_to=version, at=datetime.now(UTC))
    faults.point("register.alias_moved", version=version, alias=alias)


__getattr__ = tasks_on_first_use(
    globals(),
    register_task=lambda: step(register, name="register-model"),
)
