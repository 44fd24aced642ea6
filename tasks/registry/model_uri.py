"""Where a model to score comes from: a ModelDirectory path, or a version in the MLflow registry.

``models:/<name>@<alias>`` and ``models:/<name>/<version>`` resolve to one version, downloaded
(``model.json`` and ``model.onnx``) into a per-version cache laid out as a ModelDirectory. An alias
is resolved at each call, so a promotion is picked up; a cached folder is reused only while the
registry still names the same run; downloads are atomic and locked. Whoever reads a cached folder
(a scoring, a promotion) holds its lease (:func:`model_in_use`), and ``imageops gc`` leaves a
leased folder alone. MLflow is imported only for a URI: scoring a ModelDirectory path does not pay
for it.
Details: docs/promotion.md#scoring-a-registered-model-models-uris.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from models.atomic import atomic_directory, write_json
from models.bounded_parse import parse_json, shown
from models.directory import ONNX
from models.locks import holding, sharing
from models.untrained import MODEL_JSON
from tasks.inference.export import sha256_file
from tasks.registry.champion_record import BY_HAND_SEEN, CHAMPION_ALIAS, CHAMPION_TAG, reconcile
from tasks.shared.errors import RegistryError, RegistryUnreachableError
from tasks.shared.settings import Settings, get_settings, redact_uri
from tasks.shared.step import step, step_logger, tasks_on_first_use

if TYPE_CHECKING:
    from mlflow.models import Model
    from mlflow.tracking import MlflowClient

MODELS_SCHEME = "models:/"
CACHE_DIR = "registry-cache"
ORIGIN = "registry.json"  # what the cached folder was downloaded from
LOCK_TIMEOUT_S = 600.0  # a download of a large model by another process, not a dead lock
# models:/<name>@<alias> or models:/<name>/<version>; a name may itself contain '/' or '@'.
_BY_ALIAS = re.compile(r"^models:/(?P<name>.+)@(?P<alias>[\w\-]+)$")
# Up to 4,000 digits: int() refuses more than 4,300 (a ValueError, not a refusal).
_BY_VERSION = re.compile(r"^models:/(?P<name>.+)/(?P<version>\d{1,4000})$")
_NOT_FOUND = {"RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"}
# MLflow numbers versions in a SQL INTEGER column: PostgreSQL's and MySQL's end at 2^31 - 1. A
# larger number is no version anywhere (SQLite would fail to bind it: not a retryable error).
MAX_VERSION = 2**31 - 1


@dataclass(frozen=True)
class CachedModel:
    """A registry model version, downloaded: what was asked for, what it resolved to, where."""

    uri: str
    name: str
    version: int
    alias: str | None
    run_id: str
    source: str
    path: Path


def is_registry_uri(model: str | Path) -> bool:
    """True for a ``models:/`` URI (a Path never is one)."""
    return isinstance(model, str) and model.startswith(MODELS_SCHEME)


def parse_model_uri(uri: str) -> tuple[str, str | None, int | None]:
    """``(name, alias, version)`` of a ``models:/`` URI; exactly one of alias and version is set.

    Raises RegistryError for other forms (``models:/<name>/latest``, stages, logged-model ids):
    scoring names one version, by alias or by number, so the model it used is never a guess.
    """
    if match := _BY_ALIAS.match(uri):
        return match["name"], match["alias"], None
    if match := _BY_VERSION.match(uri):
        return match["name"], None, int(match["version"])
    raise RegistryError(
        f"{uri!r} is not a model URI scoring can use.",
        "Use models:/<name>@<alias> (e.g. models:/imageops-classifier@champion) or "
        "models:/<name>/<version>, or pass a ModelDirectory path.",
    )


def _folder_name(name: str) -> str:
    """A file-system-safe folder for a registered model name; a short hash keeps names apart."""
    safe = re.sub(r"[^\w.\-]", "_", name)
    if safe == name:
        return name
    return f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def cache_path(settings: Settings, name: str, version: int) -> Path:
    """The folder a registry model version is (or will be) cached in."""
    return settings.home_dir / CACHE_DIR / _folder_name(name) / str(version)


def download_lock(entry: Path) -> Path:
    """The lock file held while ``entry`` (a cached version's folder) is downloaded or removed."""
    return entry.with_name(entry.name + ".lock")


def lease_path(entry: Path) -> Path:
    """The lock file whoever reads ``entry`` holds shared (:func:`model_in_use`), and gc alone."""
    return entry.with_name(entry.name + ".lease")


def _client(settings: Settings) -> MlflowClient:
    from mlflow.tracking import MlflowClient

    # An explicit client, not the process-wide tracking URI: resolving never re-points MLflow.
    return MlflowClient(tracking_uri=settings.tracking_uri, registry_uri=settings.registry_uri)


def _not_found(
    client: MlflowClient, uri: str, name: str, alias: str | None, version: int | None, registry: str
) -> RegistryError:
    """The error for a name, alias or version the registry does not have, with what it has."""
    from mlflow.exceptions import MlflowException

    registry = redact_uri(registry)
    try:
        registered = client.get_registered_model(name)
    except MlflowException:
        return RegistryError(
            f"{uri}: no registered model {name!r} in {registry}.",
            "Register a model first (`imageops register`), or check the name and "
            "IMAGEOPS_MLFLOW_TRACKING_URI / IMAGEOPS_MLFLOW_REGISTRY_URI.",
        )
    aliases = ", ".join(f"@{a} -> v{v}" for a, v in sorted(registered.aliases.items()))
    if alias is not None:
        return RegistryError(
            f"{uri}: registered model {name!r} has no alias @{alias} in {registry}.",
            f"Its aliases: {aliases or 'none'}. Promote a version to @{alias} first, or use "
            f"models:/{name}/<version>.",
        )
    return RegistryError(
        f"{uri}: registered model {name!r} has no version {version} in {registry}.",
        f"Its aliases: {aliases or 'none'}. Use a version number the registry lists.",
    )


def _is_cached(path: Path, run_id: str, source: str, onnx_sha256: str | None) -> bool:
    """True when ``path`` is a complete download of the version with this run and source, whose
    ONNX file is still the one registered (checked on every use: a cache is a folder anyone can
    write to, and a replaced model.onnx would score with another model)."""
    try:
        origin = json.loads((path / ORIGIN).read_text())
    except (OSError, ValueError):
        return False
    complete = (
        origin.get("run_id") == run_id
        and origin.get("source") == source
        and (path / MODEL_JSON).is_file()
        and (path / ONNX).is_file()
    )
    if complete and onnx_sha256 and sha256_file(path / ONNX) != onnx_sha256:
        step_logger(__name__).warning(
            "%s is not the ONNX file the version was registered with (its sha256 differs): "
            "downloading the version again",
            path / ONNX,
        )
        return False
    return complete


def _download(
    client: MlflowClient, settings: Settings, cached: CachedModel, onnx_sha256: str | None
) -> None:
    """Fetch model.json and the ONNX file of one version into ``cached.path``, atomically."""
    from mlflow.artifacts import download_artifacts
    from mlflow.exceptions import MlflowException
    from mlflow.models import Model

    from tasks.registry.register import DIRECTORY_ARTIFACTS

    uri = client.get_model_version_download_uri(cached.name, str(cached.version))
    fetch = {"tracking_uri": settings.tracking_uri, "registry_uri": settings.registry_uri}
    with atomic_directory(cached.path) as tmp:
        staging = tmp / ".download"
        mlmodel = Model.load(
            download_artifacts(artifact_uri=f"{uri}/MLmodel", dst_path=str(staging), **fetch)
        )
        onnx_path = _onnx_path(mlmodel)
        if onnx_path is None:
            raise RegistryError(
                f"{cached.uri} (version {cached.version}) has no ONNX model.",
                "Scoring runs ONNX models only: register the model with `imageops register`.",
            )
        onnx_file = download_artifacts(
            artifact_uri=f"{uri}/{onnx_path}", dst_path=str(staging), **fetch
        )
        shutil.move(onnx_file, tmp / ONNX)
        try:
            model_json = download_artifacts(
                run_id=cached.run_id,
                artifact_path=f"{DIRECTORY_ARTIFACTS}/{MODEL_JSON}",
                dst_path=str(staging),
                **fetch,
            )
        except (MlflowException, OSError) as exc:
            raise RegistryError(
                f"{cached.uri} (version {cached.version}): run {cached.run_id} has no "
                f"{DIRECTORY_ARTIFACTS}/{MODEL_JSON}.",
                "Register the model with `imageops register`, which logs model.json beside the "
                "ONNX model.",
            ) from exc
        shutil.move(model_json, tmp / MODEL_JSON)
        shutil.rmtree(staging)
        # The registry tags each version with its ONNX file's sha256: a download that does not
        # match is a truncated transfer or an artifact changed after registration.
        if onnx_sha256 and sha256_file(tmp / ONNX) != onnx_sha256:
            raise RegistryError(
                f"{cached.uri} (version {cached.version}): the downloaded {ONNX} does not match "
                "the sha256 the version was registered with.",
                "Try again; if it persists the artifact store was changed after registration.",
            )
        _check_classes(tmp, mlmodel, cached)
        write_json(
            tmp / ORIGIN,
            {**asdict(cached), "path": None, "registry_uri": redact_uri(settings.registry_uri)},
        )


def _onnx_path(mlmodel: Model) -> str | None:
    """Where a version keeps its ONNX file, relative to the model: the pyfunc's ONNX artifact
    (:func:`tasks.registry.register.register`), or the ONNX flavor's file (versions registered
    before)."""
    from tasks.registry.register import ONNX_ARTIFACT

    pyfunc = mlmodel.flavors.get("python_function", {})
    artifact = (pyfunc.get("artifacts") or {}).get(ONNX_ARTIFACT)
    if artifact is not None:
        return artifact["path"]
    flavor = mlmodel.flavors.get("onnx")
    return flavor["data"] if flavor is not None else None


def _check_classes(folder: Path, mlmodel: Model, cached: CachedModel) -> None:
    """Refuse a model.json whose classes are not the ONNX model's (the run was re-registered)."""
    classes = (mlmodel.metadata or {}).get("classes")
    if classes is None:
        return
    where = f"{cached.uri} (version {cached.version}): model.json in run {cached.run_id}"
    try:
        logged = parse_json((folder / MODEL_JSON).read_bytes()).get("classes")
    except (OSError, ValueError, AttributeError) as exc:  # unreadable, not JSON, not an object
        raise RegistryError(
            f"{where} is not a model.json imageops wrote ({shown(exc)}).",
            "Register the model again from the folder `imageops train` wrote.",
        ) from exc
    if logged != classes:
        raise RegistryError(
            f"{where} lists classes {shown(logged)}, the registered ONNX model {shown(classes)}.",
            "A later registration into the same run replaced model.json: register the model "
            "again so the version and its model.json agree.",
        )


def _record_unreported_move(client: MlflowClient, name: str) -> None:
    """Record a move of ``@champion`` that no webhook reported (embedded mode has no MLflow
    server to send one), so the tags stop naming the old champion. Best effort: the alias is the
    truth, and a registry this caller may only read keeps its tags until a promotion."""
    from mlflow.exceptions import MlflowException

    try:
        reconcile(client, name, CHAMPION_ALIAS, by_hand=BY_HAND_SEEN)
    except MlflowException as exc:
        step_logger(__name__).warning(
            "Could not record the hand-made move of %s@%s: %s", name, CHAMPION_ALIAS, exc.message
        )


def fetch_registered_model(uri: str, settings: Settings | None = None) -> CachedModel:
    """Resolve ``uri`` to one model version and make sure it is in the local cache.

    Raises RegistryError for a malformed URI, an unknown name, alias or version (the message
    lists the aliases the model has), a version without an ONNX model or model.json, or a
    download that does not match the registered sha256.
    """
    from mlflow.exceptions import MlflowException

    settings = settings or get_settings()
    name, alias, number = parse_model_uri(uri)
    client = _client(settings)
    if number is not None and number > MAX_VERSION:
        raise _not_found(client, uri, name, None, number, settings.registry_uri)
    try:
        if alias is not None:
            version = client.get_model_version_by_alias(name, alias)
        else:
            version = client.get_model_version(name, str(number))
    except MlflowException as exc:
        if exc.error_code in _NOT_FOUND:
            raise _not_found(client, uri, name, alias, number, settings.registry_uri) from exc
        # Unreachable or failing: worth a retry. MLflow's message echoes the URL, password too.
        raise RegistryUnreachableError(
            f"{uri}: the MLflow registry at {redact_uri(settings.registry_uri)} failed: "
            f"{redact_uri(exc.message)}",
            "Check that the server runs and is reachable, and IMAGEOPS_MLFLOW_TRACKING_URI / "
            "IMAGEOPS_MLFLOW_REGISTRY_URI.",
        ) from None
    if alias == CHAMPION_ALIAS and not (version.tags or {}).get(CHAMPION_TAG, "").startswith("yes"):
        _record_unreported_move(client, name)
    cached = CachedModel(
        uri=uri,
        name=name,
        version=int(version.version),
        alias=alias,
        run_id=version.run_id or "",
        source=version.source or "",
        path=cache_path(settings, name, int(version.version)),
    )
    log = step_logger(__name__)
    lock = download_lock(cached.path)
    busy = RegistryError(
        f"Waited {LOCK_TIMEOUT_S:.0f} s for {lock}: another process has been downloading "
        f"{uri} into the cache all that time.",
        "Check for a stuck `imageops` process using this cache and stop it, then run again.",
    )
    with holding(lock, LOCK_TIMEOUT_S, busy):
        registered_sha256 = version.tags.get("onnx_sha256")
        if _is_cached(cached.path, cached.run_id, cached.source, registered_sha256):
            log.info("%s is version %s, cached in %s", uri, cached.version, cached.path)
            return cached
        _download(client, settings, cached, registered_sha256)
    log.info("%s is version %s, downloaded to %s", uri, cached.version, cached.path)
    return cached


def resolve_model(model: str | Path, settings: Settings | None = None) -> Path:
    """The local ModelDirectory to score with: a path as given, a ``models:/`` URI downloaded.

    See :func:`fetch_registered_model` for the errors a URI can raise.
    """
    if not is_registry_uri(model):
        return Path(model)
    return fetch_registered_model(str(model), settings).path


@contextmanager
def leased(cached: CachedModel, settings: Settings | None = None) -> Iterator[CachedModel]:
    """Hold the lease of a fetched version's cache folder for the block: ``imageops gc`` keeps a
    leased folder, however long the reader scores with it.

    Taken after the fetch, so a gc may have removed the folder in between: it is then fetched
    again (the same version, not what an alias names now) under the lease.
    """
    lease = lease_path(cached.path)
    busy = RegistryError(
        f"Waited {LOCK_TIMEOUT_S:.0f} s for {lease}: `imageops gc` has been removing "
        f"{cached.path} all that time.",
        "Check for a stuck `imageops gc` process and stop it, then run again.",
    )
    with sharing(lease, LOCK_TIMEOUT_S, busy):
        if not (cached.path / ORIGIN).is_file():
            again = fetch_registered_model(
                f"{MODELS_SCHEME}{cached.name}/{cached.version}", settings
            )
            cached = replace(again, uri=cached.uri, alias=cached.alias)
        yield cached


@contextmanager
def model_in_use(model: str | Path, settings: Settings | None = None) -> Iterator[Path]:
    """:func:`resolve_model` for the block, a URI's cache folder leased (:func:`leased`)."""
    if not is_registry_uri(model):
        yield Path(model)
        return
    with leased(fetch_registered_model(str(model), settings), settings) as cached:
        yield cached.path


__getattr__ = tasks_on_first_use(
    globals(),
    fetch_registered_model_task=lambda: step(fetch_registered_model, name="fetch-registered-model"),
    resolve_model_task=lambda: step(resolve_model, name="resolve-model"),
)
