"""Which registry-cache entries may go: versions no alias points at.

The cache (:mod:`tasks.registry.model_uri`) keeps one folder per version ever scored by URI. A
version an alias names is what scoring asks for next (``models:/<name>@champion``), so it stays;
any other entry is downloaded again if a URI names it. Entries of a model this registry does not
know are kept (they may come from another registry), and so is an entry someone reads now (a
scoring or a promotion holds its lease, :func:`tasks.registry.model_uri.model_in_use`).
Details: docs/training.md#disk-space.
"""

from __future__ import annotations

from contextlib import ExitStack
from functools import partial
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities.model_registry import RegisteredModel
from mlflow.exceptions import MlflowException

from models.locks import acquire
from tasks.registry.model_uri import CACHE_DIR, cache_path, download_lock, lease_path
from tasks.shared.errors import RegistryError, RegistryUnreachableError
from tasks.shared.reclaim import Reclaimable, trash
from tasks.shared.settings import Settings, redact_uri

REGISTRY_CACHE = "registry cache"


def _registered_models(client: MlflowClient, settings: Settings) -> list[RegisteredModel]:
    models: list[RegisteredModel] = []
    token = None
    try:
        while True:
            page = client.search_registered_models(max_results=100, page_token=token)
            models += list(page)
            token = page.token
            if not token:
                return models
    except MlflowException as exc:
        raise RegistryUnreachableError(
            f"The MLflow registry at {redact_uri(settings.registry_uri)} did not list its "
            f"models: {redact_uri(exc.message)}",
            "Check that the server runs and IMAGEOPS_MLFLOW_REGISTRY_URI, then run `imageops gc` "
            "again; nothing was removed.",
        ) from None


def _aliased(client: MlflowClient, name: str) -> set[int]:
    return {int(v) for v in client.get_registered_model(name).aliases.values()}


def unaliased_cache_entries(settings: Settings) -> list[Reclaimable]:
    """The cached versions of registered models that no alias points at now."""
    root = settings.home_dir / CACHE_DIR
    if not root.is_dir():
        return []
    client = MlflowClient(tracking_uri=settings.tracking_uri, registry_uri=settings.registry_uri)
    models = _registered_models(client, settings)
    by_folder = {cache_path(settings, m.name, 0).parent.name: m for m in models}
    found = []
    for folder in sorted(p for p in root.iterdir() if p.name in by_folder):
        model = by_folder[folder.name]
        aliased = {int(v) for v in model.aliases.values()}
        for entry in sorted(folder.iterdir()):
            if not entry.is_dir() or entry.is_symlink() or not entry.name.isdigit():
                continue
            if int(entry.name) in aliased:
                continue
            found.append(
                Reclaimable.at(
                    REGISTRY_CACHE,
                    entry,
                    f"{model.name} version {entry.name} has no alias",
                    partial(_remove_entry, client, model.name, entry),
                )
            )
    return found


def _remove_entry(client: MlflowClient, name: str, entry: Path) -> bool:
    """Remove a cached version holding its download lock and its lease alone, if still no alias
    points at it; False (kept) while it is downloaded or read, or once an alias names it."""
    with ExitStack() as alone:
        try:
            for lock in (download_lock(entry), lease_path(entry)):
                alone.callback(acquire(lock, 0, RegistryError(f"{lock} is held.")).release)
        except RegistryError:  # being downloaded, or read by a scoring or a promotion
            return False
        try:
            if int(entry.name) in _aliased(client, name):  # promoted since it was listed
                return False
        except MlflowException:  # the registry does not answer now: keep it
            return False
        trash(entry)
    return True
