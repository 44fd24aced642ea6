"""Which DVC cache entries may go: those no ``.dvc`` file or ``dvc.lock`` refers to, in the work
tree, in git's HEAD, at the tip of any local branch or tag, or in a DVC experiment.

A version committed on another branch (or only tagged) is one ``git checkout`` away: removing its
objects would leave that checkout without data whenever the remote does not have them.

Listed the way ``dvc gc`` decides (DVC's own ``used_objs`` over the same revisions), and removed by
``dvc gc`` itself (``Repo.gc``), which recomputes what is used under its lock, so a version
committed meanwhile is kept. It removes a folder's ``.dir`` listing before the files, so a crash
never leaves a listing whose files are gone. Outside git there is only the work tree to keep.
Details: docs/training.md#disk-space.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.data.versioning import _dvc_error, _ensure, _serialised
from tasks.shared.reclaim import Reclaimable, disk_size
from tasks.shared.settings import Settings

if TYPE_CHECKING:
    from dvc.repo import Repo

DVC_CACHE = "DVC cache"


def _kept_revisions(repo: Repo) -> dict[str, Any]:
    """Beyond the work tree, when there is a commit: git's HEAD (detached too), every local
    branch and tag, and every experiment (``dvc gc -w --rev HEAD -a -T --all-experiments``)."""
    from dvc.scm import NoSCM

    if isinstance(repo.scm, NoSCM):
        return {}
    try:
        repo.scm.get_rev()
    except Exception:  # a git repository without a commit yet: only the work tree
        return {}
    return {"rev": "HEAD", "all_branches": True, "all_tags": True, "all_experiments": True}


def _unused_objects(repo: Repo, kept: dict[str, Any]) -> list[Path]:
    """The cache files ``Repo.gc`` with the same arguments would remove (its own loop)."""
    revs = [kept["rev"]] if "rev" in kept else None
    refs = {key: value for key, value in kept.items() if key != "rev"}
    used: set[Any] = set()
    for objects in repo.used_objs(revs=revs, **refs).values():
        used.update(objects)
    paths: list[Path] = []
    seen = []
    for _scheme, odb in repo.cache.by_scheme():
        if not odb or odb in seen:
            continue
        seen.append(odb)
        hashes = {h.value for h in used if h.name == odb.hash_name}
        paths += [Path(odb.oid_to_path(oid)) for oid in odb.all() if oid not in hashes]
    return paths


def unused_dvc_cache(settings: Settings) -> list[Reclaimable]:
    """The project's DVC cache files nothing kept refers to, as one entry (none without DVC)."""
    from dvc.exceptions import DvcException

    if not (settings.project_root.resolve() / ".dvc").is_dir():
        return []
    with _serialised(settings), _ensure(settings) as repo:
        try:
            paths = _unused_objects(repo, _kept_revisions(repo))
        except DvcException as exc:
            raise _dvc_error(
                exc, "list its unused cache", "Check `dvc status`, then run again."
            ) from exc
        cache = Path(repo.cache.local.path)
    if not paths:
        return []
    return [
        Reclaimable(
            kind=DVC_CACHE,
            path=cache,
            size=sum(disk_size(p) for p in paths),
            reason=f"{len(paths)} objects no .dvc file of the work tree, HEAD, a local branch "
            "or tag, or an experiment refers to",
            remove=lambda: collect_dvc_garbage(settings),
        )
    ]


def collect_dvc_garbage(settings: Settings) -> bool:
    """``dvc gc`` keeping the work tree, HEAD, every local branch and tag, and every experiment;
    raises VersioningError."""
    from dvc.exceptions import DvcException

    with _serialised(settings), _ensure(settings) as repo:
        try:
            repo.gc(workspace=True, **_kept_revisions(repo))
        except DvcException as exc:
            raise _dvc_error(
                exc, "remove its unused cache", "Check `dvc status`, then run again."
            ) from exc
    return True
