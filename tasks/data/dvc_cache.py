"""How the project's DVC cache holds the data: linked to the working copy, not copied beside it.

Details: docs/images.md#links.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tasks.data.file_links import can_hardlink, can_reflink

if TYPE_CHECKING:
    from dvc.repo import Repo

# DVC links files from its cache rather than copying them: a clone where the file system makes
# one, else a hard link (DVC then makes the file read-only: `dvc unprotect` gives a copy back).
CACHE_TYPE = "reflink,hardlink,copy"


def link_from_cache(repo: Repo, level: str) -> Repo:
    """``repo`` with ``cache.type`` set to :data:`CACHE_TYPE` at ``level``, reopened to apply it.

    At init outside git (in git, ``versioning._with_autostage`` sets it), and for a repository
    that has no cache type at any level yet (one an earlier imageops or a person made): the
    choice DVC leaves to the user, made for them only where they made none. Always in the shared
    ``.dvc/config``, where ``dvc config cache.type`` writes: a value in ``config.local`` would
    silently outrank the one a user sets there later. In git, the change shows as a modified
    ``.dvc/config`` for the user to commit (``imageops version`` names it).
    """
    from dvc.repo import Repo

    with repo.config.edit(level) as conf:
        conf["cache"]["type"] = CACHE_TYPE
    root = repo.root_dir
    repo.close()
    return Repo(root)


def linking_add(repo: Repo, target: Path) -> Repo:
    """``repo`` as ``dvc add`` of ``target`` should use it to link the files into its cache.

    DVC 3 links an added file into the cache only when ``hardlink`` comes first in the cache
    type; with :data:`CACHE_TYPE` on a file system that cannot clone (ext4) it copies every file
    into the cache beside the workspace's: two copies. And with ``hardlink,copy`` a file whose
    content the cache already holds (an unchanged image in a new conversion) stays a copy of its
    own. So where the cache cannot reflink but can hard-link ``target``'s files (one file
    system), and the type is imageops' own, the add runs with ``hardlink`` alone (this process
    only; the file keeps :data:`CACHE_TYPE`, which checkouts use as it is). A type the user
    chose is used as it is.
    """
    from dvc.repo import Repo

    try:
        if repo.config["cache"].get("type") != CACHE_TYPE.split(","):
            return repo
        cache_dir = Path(repo.cache.local.path)
        cache_dir.mkdir(parents=True, exist_ok=True)
        if can_reflink(cache_dir) or not can_hardlink(cache_dir, target):
            return repo
    except BaseException:
        repo.close()
        raise
    root = repo.root_dir
    repo.close()
    return Repo(root, config={"cache": {"type": ["hardlink"]}})
