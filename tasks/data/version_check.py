"""A data version is the folder its manifest describes: checked before it is pushed, undone if not.

``dvc add`` lists a folder's files as they are while it walks them. Imageops' own steps never
rewrite a folder then (they and ``version`` take its lock: :func:`tasks.data.datasets.
holding_folders`), but any other writer, or a hand edit, can leave a listing that is not the one
``manifest.json`` gives: a version training would record and no one could trust. So the listing
DVC made is compared with the manifest before the push, and when they disagree what the add
recorded (the ``.dvc`` pointer, the ``.gitignore`` beside it, their entries in git's index) is
put back as it was: nothing is recorded or pushed.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from models.atomic import write_bytes
from tasks.data.dvc_repairs import git_root
from tasks.data.imagedir import MANIFEST
from tasks.data.manifest_stream import iter_images
from tasks.shared.errors import ImageOpsError, VersionMismatchError

if TYPE_CHECKING:
    from dvc.repo import Repo

_SHOWN = 3  # paths named per kind of difference
_NO_ENTRY = "0 " + "0" * 40  # git update-index --index-info: mode 0 removes the entry
_HINT = (
    "Something changed the folder while it was versioned, or its files were changed by hand: "
    "write it again with the step that made it (convert, split, transform apply), then version "
    "it again."
)


def recorded_state(target: Path) -> Callable[[], None]:
    """What ``dvc add`` of ``target`` will record, kept now: call the result to put it back.

    The ``.dvc`` pointer and the ``.gitignore`` beside it, as files and as git's index has them
    (DVC stages both when ``core.autostage`` is on).
    """
    files = [target.parent / f"{target.name}.dvc", target.parent / ".gitignore"]
    contents = {f: f.read_bytes() if f.is_file() else None for f in files}
    work_tree = git_root(target.parent)
    index = _index_entries(work_tree, files) if work_tree is not None else None

    def put_back() -> None:
        for file, content in contents.items():
            if content is None:
                file.unlink(missing_ok=True)
            else:
                write_bytes(file, content)
        if work_tree is not None and index is not None:
            names = _names(work_tree, files)
            lines = "".join(f"{index.get(name, _NO_ENTRY)}\t{name}\n" for name in names)
            _git(work_tree, "update-index", "--index-info", stdin=lines)

    return put_back


def _names(work_tree: Path, files: list[Path]) -> list[str]:
    return [f.resolve().relative_to(work_tree.resolve()).as_posix() for f in files]


def _index_entries(work_tree: Path, files: list[Path]) -> dict[str, str] | None:
    """``{path: "mode sha"}`` of ``files`` in git's index; None when git does not answer."""
    listed = _git(work_tree, "ls-files", "--stage", "-z", "--", *_names(work_tree, files))
    if listed is None:
        return None
    entries = {}
    for line in filter(None, listed.split("\0")):
        info, _, name = line.partition("\t")
        mode, sha, _stage = info.split(" ")
        entries[name] = f"{mode} {sha}"
    return entries


def _git(work_tree: Path, *args: str, stdin: str | None = None) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=work_tree, input=stdin, capture_output=True, text=True,
            timeout=60, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def mismatch(repo: Repo, target: Path, md5: str) -> VersionMismatchError | None:
    """Why the version ``md5`` of ``target`` must be refused: its files are not the ones its
    manifest lists; None when they are, or when nothing says what it should hold (a file, a
    folder without ``manifest.json``)."""
    if not md5.endswith(".dir"):
        return None
    listing = json.loads(Path(repo.cache.local.oid_to_path(md5)).read_bytes())
    files = {item["relpath"]: item["md5"] for item in listing}
    manifest_md5 = files.pop(MANIFEST, None)
    if manifest_md5 is None:
        return None
    problem = _disagreement(target, manifest_md5, set(files))
    if problem is None:
        return None
    return VersionMismatchError(
        f"Not versioned: {target} as DVC listed it ({md5}) {problem}. Nothing was recorded or "
        "pushed.",
        _HINT,
    )


def changed_while_added(target: Path, exc: FileNotFoundError) -> VersionMismatchError:
    """The refusal when a file of ``target`` went away while ``dvc add`` read it."""
    return VersionMismatchError(
        f"Not versioned: {target} changed while DVC added it ({exc.filename} went away). "
        "Nothing was recorded or pushed.",
        _HINT,
    )


def _disagreement(target: Path, manifest_md5: str, files: set[str]) -> str | None:
    """How ``files`` (DVC's listing, less the manifest) differ from the manifest's images."""
    try:
        with (target / MANIFEST).open("rb") as fh:
            digest = hashlib.file_digest(fh, lambda: hashlib.md5(usedforsecurity=False))
        if digest.hexdigest() != manifest_md5:
            return f"has another {MANIFEST} than the folder has now"
        listed = {entry.path for entry in iter_images(target)}
    except (OSError, ImageOpsError) as exc:
        return f"has a {MANIFEST} that cannot be read ({exc})"
    missing, extra = sorted(listed - files), sorted(files - listed)
    if not (missing or extra):
        return None
    what = [f"{len(missing)} listed images missing ({_some(missing)})"] if missing else []
    what += [f"{len(extra)} files not listed ({_some(extra)})"] if extra else []
    return (
        f"holds {len(files)} files besides {MANIFEST}, which lists {len(listed)} images: "
        + "; ".join(what)
    )


def _some(paths: list[str]) -> str:
    return ", ".join(paths[:_SHOWN]) + (", ..." if len(paths) > _SHOWN else "")
