"""Data versioning: a data folder becomes a DVC-tracked, pushed version identified by its md5.

That md5 is recorded with every training run, so a model traces to the images it learned from.
Every DVC operation holds a file lock first (two DVC commands in one repository fail), and what a
kill or a failure leaves that DVC does not get past itself is repaired (:mod:`.dvc_repairs`). Any
machine gets a version back by its md5 from the remote (:func:`fetch_version`), so machines share
data through the remote only. Details: docs/internals.md#data-versioning.
"""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from models.atomic import atomic_directory, write_text
from models.bounded_parse import parse_yaml
from tasks.data.datasets import holding_folders
from tasks.data.dvc_cache import CACHE_TYPE, link_from_cache, linking_add
from tasks.data.dvc_logs import quiet_dvc_logs
from tasks.data.dvc_repairs import git_root, init_cut_short, nothing_half_done, repair_rwlock
from tasks.data.version_check import changed_while_added, mismatch, recorded_state
from tasks.data.version_tags import LATEST, check_tag, dataset_name, write_tags
from tasks.shared import faults
from tasks.shared.errors import DataUnavailableError, InvalidParameterError, VersioningError
from tasks.shared.project_lock import taking_turns
from tasks.shared.settings import Settings, get_settings, redact_uri
from tasks.shared.step import step, step_logger, tasks_on_first_use

if TYPE_CHECKING:  # importing DVC takes half a second; only the functions below need it
    from dvc.repo import Repo

REMOTE_NAME = "local"
# Under the settings' home: the versions this machine fetched by md5, in a DVC repository of
# imageops' own (outside git), each checked out from its cache as a folder named by the md5.
VERSIONS_DIR = "data-versions"
_DIR_MD5 = re.compile(r"^([0-9a-f]{32})\.dir$")
_FILE_MD5 = re.compile(r"^([0-9a-f]{32})$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # DVC colours its messages' links
LOCK_FILE = "dvc.lock"
# A push of a large data set to a slow remote can take long; past this, something is stuck.
LOCK_TIMEOUT_SECONDS = 3600.0
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _serialised(settings: Settings) -> AbstractContextManager[None]:
    """Hold the project's DVC lock (one DVC operation at a time, across processes)."""
    return taking_turns(
        settings.home_dir / LOCK_FILE,
        LOCK_TIMEOUT_SECONDS,
        VersioningError,
        "another imageops step versioning data in this project",
        "Check for a stuck `imageops` process (it holds the lock) and stop it, then retry.",
    )


def _remote_url(settings: Settings) -> str:
    """The remote as DVC should store it: URLs as given, local folders absolute.

    DVC resolves a relative folder against ``.dvc/``, not against where the user stood.
    """
    url = settings.dvc_remote
    if _URL.match(url):
        return url
    path = Path(url).expanduser()
    return str(path if path.is_absolute() else (settings.project_root / path).resolve())


def _dvc_error(exc: Exception, action: str, hint: str) -> VersioningError:
    """A DVC failure as a VersioningError that says what to do, by the kind of failure."""
    from dvc.config import RemoteConfigError
    from dvc.exceptions import FileTransferError
    from dvc.lock import LockError
    from dvc.output import OutputAlreadyTrackedError

    if isinstance(exc, LockError):
        hint = (
            "Another DVC command (outside imageops) is running in this repository: run again "
            "once it has finished."
        )
    elif isinstance(exc, OutputAlreadyTrackedError):
        hint = (
            "Git already tracks these files: untrack them with `git rm -r --cached PATH` and "
            "commit, then version again (DVC tracks the data, git tracks the .dvc file)."
        )
    elif isinstance(exc, FileTransferError | RemoteConfigError):
        hint = (
            "Check that the DVC remote (IMAGEOPS_DVC_REMOTE_URL) exists, is reachable and is "
            "writable, then retry."
        )
    # A remote's URL in DVC's message may carry a password (https://user:pass@host).
    return VersioningError(redact_uri(f"DVC could not {action}: {exc}"), hint)


def _configure_remote(repo: Repo, settings: Settings) -> None:
    """Make ``local`` -> settings' remote the default, in ``.dvc/config.local``, if not already.

    An ``s3://`` remote gets ``endpointurl`` from ``settings.s3_endpoint_url`` when that is set.

    The local level is per checkout and not committed: where the remote lives is a setting of
    this machine (a folder here, S3 elsewhere), while ``.dvc/config`` is shared through git.
    Analytics are switched off in the same place, in addition to ``DVC_NO_ANALYTICS``.
    """
    url = _remote_url(settings)
    folder = _remote_folder(settings)
    if folder is not None and not folder.exists():  # DVC would make it readable by all
        with contextlib.suppress(OSError):  # unreachable: the push says so, with its hint
            folder.mkdir(mode=0o700, parents=True)
    # An s3:// remote on another server than AWS (SeaweedFS, MinIO) needs its endpoint; the
    # keys stay in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, which DVC's S3 client reads.
    endpoint = settings.s3_endpoint_url if url.startswith("s3://") else None
    current = repo.config.read("local")
    remote = current.get("remote", {}).get(REMOTE_NAME, {})
    core = current.get("core", {})
    if (
        str(remote.get("url", "")) == url
        and (endpoint is None or str(remote.get("endpointurl", "")) == endpoint)
        and core.get("remote") == REMOTE_NAME
        and str(core.get("analytics", "")).lower() == "false"
    ):
        return  # idempotent: no rewrite, so the file's mtime says when it last changed
    with repo.config.edit("local") as conf:
        # Keep options a user added to this remote (credentials, region, endpoint when
        # IMAGEOPS_S3_ENDPOINT_URL does not say one) while it stays of one kind; a remote of
        # another kind (s3:// -> a folder) refuses them ("extra keys not allowed").
        options = conf["remote"].setdefault(REMOTE_NAME, {})
        if _scheme(str(options.get("url", url))) != _scheme(url):
            options.clear()
        options["url"] = url
        if endpoint is not None:
            options["endpointurl"] = endpoint
        conf["core"]["remote"] = REMOTE_NAME
        conf["core"]["analytics"] = False


def _remote_folder(settings: Settings) -> Path | None:
    """The remote's folder; None for a remote at a URL (S3 and the like)."""
    url = _remote_url(settings)
    return None if _URL.match(url) else Path(url)


def _scheme(url: str) -> str:
    """``s3``, ``gs``, ... for a URL; ``""`` for a folder."""
    return url.split("://", 1)[0] if _URL.match(url) else ""


def _with_autostage(repo: Repo) -> Repo:
    """``repo`` (just created in git) with ``core.autostage`` on, reopened so that it applies.

    With it, ``dvc add`` (and ``dvc repro``, ``dvc exp run``) stage in git the ``.dvc`` and
    ``.gitignore`` files they write, as DVC's docs advise; without it DVC only prints a hint,
    which a Prefect run's log buries. A pointer left out of git is left out of every commit and
    experiment, so that data version is not recorded where DVC looks for it. Set once, at init,
    in the shared ``.dvc/config`` (staged here): a user who turns it off later is not overruled.
    The cache's link types (:data:`CACHE_TYPE`) go in the same edit.
    """
    from dvc.repo import Repo

    with repo.config.edit("repo") as conf:
        conf["core"]["autostage"] = True
        conf["cache"]["type"] = CACHE_TYPE
    repo.scm.add([repo.config.files["repo"]])
    root = repo.root_dir
    repo.close()  # its scm_context read the configuration before the change
    return Repo(root)


def _ensure(settings: Settings) -> Repo:
    """:func:`ensure_dvc_repo` without the lock (the caller holds it)."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    quiet_dvc_logs()
    root = settings.project_root.resolve()
    if not root.is_dir():
        raise VersioningError(
            f"The project root {root} is not a folder.",
            "Set IMAGEOPS_PROJECT_ROOT to the project folder (or run imageops from it).",
        )
    dvc_dir = root / ".dvc"
    try:
        if dvc_dir.is_dir() and not init_cut_short(dvc_dir):
            repo = Repo(str(root))
        else:
            work_tree = git_root(root)
            force = dvc_dir.is_dir()  # an init cut short: start it again
            if work_tree is None:
                repo = Repo.init(str(root), no_scm=True, force=force)
                repo = link_from_cache(repo, "repo")
            else:
                # In git, DVC stages its own files and writes .gitignore entries for the data.
                repo = _with_autostage(Repo.init(str(root), subdir=work_tree != root, force=force))
        try:
            repair_rwlock(repo)
            _configure_remote(repo, settings)
            if repo.config["cache"].get("type") is None:
                repo = link_from_cache(repo, "repo")
                step_logger(__name__).info(
                    "DVC now links data from its cache (cache.type %s in %s)",
                    CACHE_TYPE,
                    repo.config.files["repo"],
                )
        except BaseException:
            repo.close()
            raise
    except DvcException as exc:
        raise _dvc_error(
            exc,
            f"set up a DVC repository in {root}",
            f"Check that {root / '.dvc'} is a DVC folder you can write, or remove it to start "
            "afresh.",
        ) from exc
    return repo


def ensure_dvc_repo(settings: Settings | None = None) -> Repo:
    """Open the DVC repository at ``settings.project_root``, creating and configuring it if needed.

    Creates ``.dvc/`` when missing (tracked by git when the project is in a git work tree, else
    with ``no_scm``), and sets the default remote ``local`` to ``settings.dvc_remote`` in
    ``.dvc/config.local``. Idempotent. The caller owns the returned repo: use it as
    ``with ensure_dvc_repo(settings) as repo: ...`` so it is closed. Raises
    :class:`VersioningError` when DVC cannot set up the repository.
    """
    settings = settings or get_settings()
    with _serialised(settings):
        return _ensure(settings)


def _inside_project(path: Path, settings: Settings) -> Path:
    root = settings.project_root.resolve()
    target = Path(path).expanduser()
    target = (target if target.is_absolute() else root / target).resolve()
    if target == root or not target.is_relative_to(root):
        raise VersioningError(
            f"{path} is not inside the project root {root}: DVC versions only data inside its "
            "repository.",
            f"Write the data under {settings.data_path} (e.g. `imageops convert SRC "
            f"{settings.data_path / 'images'}`) or set IMAGEOPS_PROJECT_ROOT to a folder that "
            "contains it.",
        )
    if not target.exists():
        raise VersioningError(f"{target} does not exist: nothing to version.")
    return target


def _tracked_md5(dvc_file: Path) -> str:
    try:
        md5 = parse_yaml(dvc_file.read_bytes())["outs"][0]["md5"]
    except (OSError, yaml.YAMLError, KeyError, IndexError, TypeError) as exc:
        raise VersioningError(
            f"{dvc_file} has no md5 for its output ({type(exc).__name__}: {exc}).",
            "Version the data again; if it persists, delete the .dvc file and retry.",
        ) from exc
    if not isinstance(md5, str) or not md5:
        raise VersioningError(f"{dvc_file} has an empty md5.", "Version the data again.")
    return md5


def _dvc_files(root: Path, targets: Iterable[Path]) -> list[Path]:
    """The files of DVC's that git must hold for ``targets`` to be reproducible from a commit.

    The repository's own ``.dvc/config``, ``.dvc/.gitignore`` and ``.dvcignore``, then each
    target's ``.dvc`` pointer and the ``.gitignore`` DVC may write beside it.
    """
    files = [root / ".dvc" / "config", root / ".dvc" / ".gitignore", root / ".dvcignore"]
    for target in targets:
        files += [target.parent / f"{target.name}.dvc", target.parent / ".gitignore"]
    return list(dict.fromkeys(f for f in files if f.is_file()))


def uncommitted(paths: Iterable[Path], settings: Settings | None = None) -> list[str]:
    """DVC's files for the versioned ``paths`` that git has not committed as they are.

    Until they are committed, no commit records these data versions: ``dvc exp run`` experiments,
    ``dvc checkout`` at another commit and a collaborator's ``dvc pull`` do not know them. Paths
    are relative to the project root (where the user runs ``git add``), staged ones included
    (``core.autostage`` stages them; they still need a commit). Empty outside git.
    """
    settings = settings or get_settings()
    root = settings.project_root.resolve()
    work_tree = git_root(root)
    if work_tree is None:
        return []
    targets = [_inside_project(p, settings) for p in paths]
    files = _dvc_files(root, targets)
    if not files:
        return []
    try:
        # --no-optional-locks: a status never takes git's index lock from a commit under way.
        status = ["git", "--no-optional-locks", "status", "--porcelain", "-z", "-uall", "--"]
        done = subprocess.run(
            [*status, *(str(f.relative_to(work_tree)) for f in files)],
            cwd=work_tree, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    if done.returncode != 0:
        return []
    # "XY path" entries, NUL-separated (-z: no quoting); paths relative to the git root.
    changed = {work_tree / entry[3:] for entry in done.stdout.split("\0") if len(entry) > 3}
    return [f.relative_to(root).as_posix() for f in files if f in changed]


def version(path: Path, settings: Settings | None = None, tags: Sequence[str] = ()) -> str:
    """``dvc add`` the folder (or file) ``path`` and ``dvc push`` it; return its md5.

    ``path`` is absolute or relative to the project root, and must be inside it. The md5 is the
    one in the ``.dvc`` file's first output (``<hash>.dir`` for a folder): the same data gives
    the same md5, so versioning unchanged data twice returns the same value and pushes nothing.
    The folder's lock is held throughout (steps that write it wait), and an ImageDirectory whose
    files are not the ones its manifest lists is neither recorded nor pushed
    (:class:`VersionMismatchError`). Once pushed, the version becomes the data set's ``latest``
    in the remote, and so do ``tags`` (:mod:`.version_tags`): any machine sharing the remote
    can name it ``<name>@latest``. Raises :class:`VersioningError` for a path outside the
    project or any DVC failure.
    """
    from dvc.exceptions import DvcException

    settings = settings or get_settings()
    tags = [LATEST, *(check_tag(t) for t in tags if t != LATEST)]
    target = _inside_project(path, settings)
    # The folder's lock before DVC's: the order every step takes them in (no deadlock).
    with (
        holding_folders(target, settings=settings),
        _serialised(settings),
        linking_add(_ensure(settings), target) as repo,
        nothing_half_done(repo, target, _remote_folder(settings)),
    ):
        put_back = recorded_state(target)
        try:
            stages = repo.add([str(target)])
            dvc_file = Path(stages[0].path)
        except DvcException as exc:
            raise _dvc_error(
                exc,
                f"add {target}",
                "Check that the folder is readable and not inside .dvc/ or .git/.",
            ) from exc
        except FileNotFoundError as exc:  # DVC's walk lost a file: another writer
            put_back()
            raise changed_while_added(target, exc) from exc
        md5 = _tracked_md5(dvc_file)
        if refused := mismatch(repo, target, md5):
            put_back()  # nothing recorded: the pointer, .gitignore and git's index as they were
            raise refused
        try:
            repo.push(targets=[str(dvc_file)])
        except DvcException as exc:
            raise _dvc_error(
                exc,
                f"push {target} to the remote {_remote_url(settings)}",
                "Check the remote (IMAGEOPS_DVC_REMOTE_URL), then version again.",
            ) from exc
        name = dataset_name(target, settings)
        try:
            write_tags(repo, name, md5, tags)
        except (DvcException, OSError) as exc:
            raise _dvc_error(
                exc,
                f"record the tags {', '.join(tags)} of {name} in {_remote_url(settings)}",
                "Check that the remote (IMAGEOPS_DVC_REMOTE_URL) is writable, then version again.",
            ) from exc
    logger = step_logger(__name__)
    logger.info("versioned %s as %s (md5 %s)", target, dvc_file.name, md5)
    if pending := uncommitted([target], settings):
        logger.info("to commit in git to record the version: %s", " ".join(pending))
    return md5


def _open_versions_repo(settings: Settings) -> Repo:
    """The DVC repository of fetched versions under ``home``, created (outside git) if needed.

    Files are linked from its cache where the file system can (reflink, then hardlink), not
    copied. An init cut short leaves ``.dvc/config`` missing or empty (a complete one says
    ``no_scm``): it is made again.
    """
    from dvc.repo import Repo

    quiet_dvc_logs()
    root = settings.home_dir / VERSIONS_DIR
    config = root / ".dvc" / "config"
    if config.is_file() and config.stat().st_size > 0:
        repo = Repo(str(root))
    else:
        root.mkdir(parents=True, exist_ok=True)
        repo = Repo.init(str(root), no_scm=True, force=(root / ".dvc").is_dir())
        with repo.config.edit("repo") as conf:
            conf["cache"]["type"] = CACHE_TYPE
        repo.close()
        repo = Repo(str(root))
    try:
        repair_rwlock(repo)
        _configure_remote(repo, settings)
    except BaseException:
        repo.close()
        raise
    return repo


def remote_description(settings: Settings) -> str:
    """The DVC remote as a message names it: its URL, and its endpoint for S3 (not redacted)."""
    remote = _remote_url(settings)
    if remote.startswith("s3://") and settings.s3_endpoint_url:
        remote += f" (at {settings.s3_endpoint_url})"
    return remote


@contextlib.contextmanager
def versions_repo(settings: Settings) -> Iterator[Repo]:
    """This machine's DVC repository of fetched versions (its remote: the settings'), held: what
    reads the remote's records (:mod:`.version_tags`) where the project has no DVC repository."""
    with _serialised(settings), _open_versions_repo(settings) as repo:
        yield repo


def _unavailable(md5: str, settings: Settings, why: str) -> DataUnavailableError:
    remote = remote_description(settings)
    return DataUnavailableError(
        redact_uri(
            f"The data set version {md5} could not be fetched from the DVC remote {remote} "
            f"to host {socket.gethostname()}: {why}"
        ),
        "Run `imageops version` on the data (on the machine that has it) so that it is pushed "
        "to this remote; check that this host reaches the remote (IMAGEOPS_DVC_REMOTE_URL, "
        "IMAGEOPS_S3_ENDPOINT_URL) with valid AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.",
    )


def fetch_version(md5: str, settings: Settings | None = None, file_name: str | None = None) -> Path:
    """The folder whose DVC md5 is ``md5`` (what :func:`version` returned), on this machine.

    A training node that has no copy of the data gets it from the DVC remote into its own cache
    (``home/data-versions``, a DVC repository of imageops' own), checked out as
    ``home/data-versions/<hash>``. Once there, a call returns it without asking the remote.
    The folder appears whole or not at all (checked out beside it, then renamed), and the DVC
    lock makes two calls at once take turns. A file's version (an archive's: no ``.dir``) is
    checked out as ``<hash>/<file_name>``, which is returned. Raises DataUnavailableError when
    the remote does not have the version or cannot be reached.
    """
    from dvc.exceptions import CheckoutError, DvcException

    settings = settings or get_settings()
    match = (_DIR_MD5 if file_name is None else _FILE_MD5).match(md5)
    if match is None or (file_name is not None and Path(file_name).name != file_name):
        raise InvalidParameterError(
            f"{md5!r} is not a data set version: a version is the md5 of a folder, 32 hex "
            "digits and `.dir` (or of a file, 32 hex digits), as `imageops version` prints it.",
            "Pass the data version recorded with the training run (its `data_version`).",
        )
    dest = settings.home_dir / VERSIONS_DIR / match.group(1)
    found = dest if file_name is None else dest / file_name
    if found.exists():
        return found  # only a complete checkout is ever renamed to this name
    with _serialised(settings), _open_versions_repo(settings) as repo:
        if found.exists():  # fetched by another call while this one waited for the lock
            return found
        for leftover in dest.parent.glob(".*.tmp.dvc"):  # a killed fetch's; we hold the lock
            leftover.unlink()
        with atomic_directory(dest) as tmp:
            out = tmp.name if file_name is None else f"{tmp.name}/{file_name}"
            dvc_file = write_text(
                tmp.with_name(f"{tmp.name}.dvc"),
                yaml.safe_dump({"outs": [{"md5": md5, "path": out, "hash": "md5"}]}),
            )
            try:
                repo.fetch(targets=[str(dvc_file)])
                repo.checkout(targets=[str(dvc_file)], force=True)
                faults.point("data.version_checked_out", md5=md5)
            except CheckoutError as exc:  # the fetch found nothing (DVC only warns)
                why = "neither the remote nor this host's DVC cache has it, or the remote did "
                raise _unavailable(md5, settings, why + "not answer.") from exc
            except DvcException as exc:
                why = _ANSI.sub("", f"{type(exc).__name__}: {exc}")
                raise _unavailable(md5, settings, why) from exc
            finally:
                dvc_file.unlink(missing_ok=True)
    step_logger(__name__).info("fetched data version %s into %s", md5, found)
    return found


__getattr__ = tasks_on_first_use(
    globals(),
    version_task=lambda: step(version, name="version"),
)
