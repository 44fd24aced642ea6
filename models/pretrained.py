"""Published pretrained weights: where the cache keeps them, fetching them, reading them as data.

torchvision's files live at ``<TORCH_HOME>/hub/checkpoints/<file>`` (torch.hub's layout); timm's
in the Hugging Face hub's cache layout under ``<TORCH_HOME>/hub/huggingface``. A file in the cache
is used as it is (no network); a missing one is downloaded there. Files are read as tensors only
(``weights_only``, safetensors): a weights file never runs code.
"""

from __future__ import annotations

import difflib
import os
import pickle
from pathlib import Path

import torch
import torchvision
from torch import nn

from models.errors import ImageOpsError, InvalidModelDirectoryError
from models.untrained import TIMM_PREFIX, ModelSpec

WEIGHTS_FILE = "model.safetensors"  # the file timm's hub repositories publish


class PretrainedWeightsMissingError(ImageOpsError):
    """Pretrained weights are neither in the local cache nor downloadable."""


def pretrained_weights_path(arch: str) -> Path:
    """Where the pretrained weights file for torchvision's ``arch`` is looked for (and
    downloaded to)."""
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(weights.url)


def hub_cache() -> Path:
    """The Hugging Face hub cache timm's weights are kept in (inside the weights cache)."""
    return Path(torch.hub.get_dir()) / "huggingface"


def weights_cached(spec: ModelSpec) -> bool:
    """Whether ``spec``'s pretrained weights are in the cache already (no network needed)."""
    if spec.arch.startswith(TIMM_PREFIX):
        return _cached_hub_file(*_hub_file(timm_pretrained_cfg(spec))) is not None
    return pretrained_weights_path(spec.arch).is_file()


def torchvision_weights_file(spec: ModelSpec) -> Path:
    """The weights file in the cache, downloaded there first when it is not yet."""
    weights = torchvision.models.get_model_weights(spec.arch).DEFAULT
    path = pretrained_weights_path(spec.arch)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            torch.hub.download_url_to_file(weights.url, str(path), progress=False)
        except Exception as exc:  # no network, proxy, DNS: all mean the same to the user
            raise PretrainedWeightsMissingError(
                f"Pretrained weights {path.name} are not in the cache and could not be "
                f"downloaded ({type(exc).__name__}).",
                f"Copy the file from {weights.url} to {path} (set IMAGEOPS_WEIGHTS_CACHE to "
                f"change the cache folder), or {without_pretrained(spec)}",
            ) from exc
    return path


def timm():
    """The timm module, imported when a timm model is used: the import takes about a second."""
    import timm

    return timm


def timm_model_name(spec: ModelSpec) -> str:
    """timm's name for ``spec`` (``timm/<name>``), refused naming similar ones if timm lacks it."""
    name = spec.arch.removeprefix(TIMM_PREFIX)
    if not timm().is_model(name):
        close = difflib.get_close_matches(name, timm().list_models(), n=5)
        raise InvalidModelDirectoryError(
            f"timm has no model {name!r}.",
            (f"Similar names: {', '.join(close)}. " if close else "")
            + "`imageops model list --timm '*resnet*'` lists them.",
        )
    return name


def timm_pretrained_cfg(spec: ModelSpec) -> dict:
    """timm's ``pretrained_cfg`` of ``spec``: its weights' hub repository and their input."""
    cfg = timm().models.get_pretrained_cfg(timm_model_name(spec))
    if cfg is None:
        raise PretrainedWeightsMissingError(
            f"timm has no pretrained weights for {spec.arch}.", without_pretrained(spec)
        )
    return cfg.to_dict()


def timm_weights_file(spec: ModelSpec) -> Path:
    """timm's weights file for ``spec`` from the hub cache, downloaded there when missing."""
    repo, filename = _hub_file(timm_pretrained_cfg(spec))
    cached = _cached_hub_file(repo, filename)
    if cached is not None:
        return cached
    from huggingface_hub import hf_hub_download

    try:
        _hub_reachable()
        return Path(hf_hub_download(repo, filename, cache_dir=hub_cache()))
    except Exception as exc:  # offline, proxy, no such file: the user's remedy is the same
        where = hub_cache() / f"models--{repo.replace('/', '--')}"
        raise PretrainedWeightsMissingError(
            f"Pretrained weights {repo}/{filename} are not in the cache and could not be "
            f"downloaded ({type(exc).__name__}).",
            f"Put the Hugging Face hub cache of {repo} (refs/main and snapshots/<commit>/"
            f"{filename}) under {where}, e.g. `hf download {repo} --cache-dir {hub_cache()}` on "
            f"a machine with network access, or {without_pretrained(spec)}",
        ) from exc


def _hub_reachable(timeout_s: float = 10.0) -> None:
    """Raise at once when the hub cannot be reached (a machine without network, a refusing
    proxy): ``hf_hub_download`` retries a refused connection five times, 23 s of back-off
    before the same error."""
    import httpx
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return  # the download looks in the cache only, and says so
    # Through the proxy of the environment, as the download would go.
    httpx.head(constants.ENDPOINT, timeout=timeout_s, trust_env=True)


def _hub_file(cfg: dict) -> tuple[str, str]:
    repo = cfg.get("hf_hub_id")
    if not repo:
        raise PretrainedWeightsMissingError(
            f"timm publishes no hub weights for {cfg.get('architecture')} "
            f"({cfg.get('tag') or 'default tag'}).",
            "Choose a tagged name that has them (`imageops model list --timm PATTERN "
            "--pretrained` lists them), or train without pretrained weights.",
        )
    return repo, cfg.get("hf_hub_filename") or WEIGHTS_FILE


def _cached_hub_file(repo: str, filename: str) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, filename, cache_dir=hub_cache())
    return Path(found) if isinstance(found, str) else None


def load_torchvision_state(path: Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The tensors in a weights file, read as data (weights_only): such a file never runs code."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError) as exc:
        # A truncated download, another format, or a pickle that wants to run code.
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise unexpected_weights(
            path, spec, f"it cannot be read as PyTorch weights ({first_line})"
        ) from exc
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise unexpected_weights(path, spec, "it holds no mapping of parameter names to tensors")
    return state


def load_into(
    model: nn.Module, state: dict[str, torch.Tensor], path: Path, spec: ModelSpec
) -> None:
    """Load every tensor of the file, or refuse the file naming what does not fit."""
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a tensor of another shape: the first such line says which
        problems = [line.strip() for line in str(exc).splitlines()[1:] if line.strip()]
        raise unexpected_weights(
            path, spec, f"a tensor has another shape ({problems[0] if problems else exc})"
        ) from exc
    problems = []
    if result.missing_keys:
        problems.append(f"{len(result.missing_keys)} missing, e.g. {result.missing_keys[0]!r}")
    if result.unexpected_keys:
        problems.append(
            f"{len(result.unexpected_keys)} unexpected, e.g. {result.unexpected_keys[0]!r}"
        )
    if problems:
        raise unexpected_weights(path, spec, f"its parameter names differ: {'; '.join(problems)}")


def unexpected_weights(path: Path | str, spec: ModelSpec, why: str) -> InvalidModelDirectoryError:
    """The error for a weights file that is not the published one for ``spec``."""
    return InvalidModelDirectoryError(
        f"{path} is not the pretrained weights file published for {spec.arch}: {why}.",
        f"Delete {path}: the next run downloads it again (or copy the published file there), "
        f"or {without_pretrained(spec)}",
    )


def without_pretrained(spec: ModelSpec) -> str:
    return (
        "start without pretrained weights: "
        f"`imageops model build DEST --name {spec.arch} --no-pretrained` "
        "(in params.yaml: `pretrained: false` under `model`)."
    )
