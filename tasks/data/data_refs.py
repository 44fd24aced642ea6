"""Data set references: ``NAME@VERSION`` names a data set version that any machine can fetch.

NAME is the data set's path under the project's ``data/`` folder (``digits/train``,
``raw/digits``); VERSION is a DVC md5 (32 hex digits; ``.dir`` optional for a folder) or a tag
that ``imageops version`` recorded in the DVC remote (``latest``, or one given with ``--tag``).
:func:`resolve_data` is the one place a step's data argument becomes a folder on this machine:

- ``NAME@VERSION``: that version, fetched from the DVC remote into this machine's cache
  (:func:`tasks.data.versioning.fetch_version`) and used from there;
- a path that exists: used as it is (relative paths from the project root);
- a path under ``data/`` that is not on this machine: the data set's ``latest`` version in the
  remote, said in one log line (a deployment's default, e.g. ``data/digits/train``, then runs on
  a machine that did not prepare the data);
- anything else: one error that says what was looked for and where.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from tasks.data.datasets import ARCHIVE_SUFFIXES
from tasks.data.version_tags import LATEST, check_tag, dataset_name, is_md5, read_tag
from tasks.shared.errors import DataUnavailableError, InvalidParameterError
from tasks.shared.settings import Settings, get_settings, redact_uri
from tasks.shared.step import step_logger

REF_SYNTAX = "NAME@VERSION (NAME: the data set's path under data/, VERSION: a DVC md5 or a tag)"
_REF = re.compile(r"^(?P<name>[^@\s][^@]*)@(?P<version>[^@/\s]+)$")


@dataclass(frozen=True)
class DataRef:
    """``name@version`` as written: a data set and an md5 or a tag of it."""

    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class ResolvedData:
    """A data argument resolved on this machine: where to read it, and what it is."""

    path: Path
    name: str | None = None  # the data set's name (its path under data/), when it has one
    md5: str | None = None  # the version, when the data came from the remote by version

    @property
    def ref(self) -> str | None:
        """``name@md5``: the reference that fetches this very data anywhere; None if unknown."""
        return reference(self.name, self.md5) if self.name and self.md5 else None


def reference(name: str, md5: str) -> str:
    """The reference of version ``md5`` of data set ``name``, as ``imageops version`` prints it."""
    return f"{name}@{md5}"


def parse_ref(text: str, settings: Settings | None = None) -> DataRef | None:
    """``text`` as a reference, or None when it is not written as one (a plain path).

    A NAME written from the project root (``data/digits/train@latest``) is taken under
    ``data/`` as well. A VERSION that is neither an md5 nor a usable tag is refused.
    """
    match = _REF.match(text.strip())
    if match is None:
        return None
    settings = settings or get_settings()
    name, version = match["name"].strip("/"), match["version"]
    data_dir = os.path.relpath(settings.data_path, settings.project_root)
    if not data_dir.startswith(".."):
        prefix = Path(data_dir).as_posix() + "/"
        name = name.removeprefix(prefix)
    if is_md5(version.lower()):
        version = version.lower()
    else:
        check_tag(version)
    return DataRef(name, version)


def ref_dataset_name(text: str) -> str:
    """The last part of the name a reference gives (``digits`` for ``raw/digits@latest``); a
    plain path as it is. What a pipeline names the data set it prepares from this source."""
    match = _REF.match(text.strip())
    return match["name"].rstrip("/") if match else text


def _is_file_name(name: str) -> bool:
    """A data set that is one file (an archive), whose md5 has no ``.dir``."""
    return name.lower().endswith(tuple(ARCHIVE_SUFFIXES))


def _remote(settings: Settings) -> str:
    from tasks.data.versioning import remote_description

    return remote_description(settings)


def _fetch(name: str, md5: str, settings: Settings) -> Path:
    from tasks.data.versioning import fetch_version

    return fetch_version(md5, settings, Path(name).name if _is_file_name(name) else None)


def _tagged(name: str, tag: str, settings: Settings) -> str | None:
    """The md5 ``tag`` of data set ``name`` points at in the DVC remote; None if none."""
    from dvc.exceptions import DvcException

    from tasks.data.versioning import versions_repo

    with versions_repo(settings) as repo:
        try:
            return read_tag(repo, name, tag)
        except (DvcException, OSError) as exc:
            raise DataUnavailableError(
                redact_uri(
                    f"The tag {tag!r} of the data set {name!r} could not be read from the DVC "
                    f"remote {_remote(settings)}: {type(exc).__name__}: {exc}"
                ),
                "Check that this host reaches the remote (IMAGEOPS_DVC_REMOTE_URL, "
                "IMAGEOPS_S3_ENDPOINT_URL) with valid AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.",
            ) from exc


def resolve_ref(ref: DataRef, settings: Settings | None = None) -> ResolvedData:
    """Version ``ref`` of its data set, fetched into this machine's cache.

    Raises DataUnavailableError naming the version (or tag) and the remote when the remote has
    no such version, no such tag, or cannot be reached.
    """
    settings = settings or get_settings()
    md5 = ref.version
    if not is_md5(md5):
        found = _tagged(ref.name, md5, settings)
        if found is None:
            raise DataUnavailableError(
                redact_uri(
                    f"The data set version {ref} is unknown: the DVC remote {_remote(settings)} "
                    f"has no tag {md5!r} for the data set {ref.name!r}."
                ),
                "Version the data set on the machine that has it (`imageops version "
                f"data/{ref.name}` records `latest`; `--tag {md5}` records this tag), or name the "
                "version by its md5.",
            )
        step_logger(__name__).info("data set %s is version %s", ref, found)
        md5 = found
    if _is_file_name(ref.name):
        md5 = md5.removesuffix(".dir")
    elif not md5.endswith(".dir"):
        md5 = f"{md5}.dir"
    return ResolvedData(path=_fetch(ref.name, md5, settings), name=ref.name, md5=md5)


def resolve_data(value: str | Path, what: str, settings: Settings | None = None) -> ResolvedData:
    """The data a step was given (a reference or a path), as a folder on this machine.

    ``what`` names the argument in messages ("training data"). See the module's docstring for
    the order; raises DataUnavailableError for a version the remote lacks, InvalidParameterError
    for a path that is neither here nor versioned.
    """
    settings = settings or get_settings()
    text = str(value)
    path = Path(text).expanduser()
    found = path if path.is_absolute() else settings.project_root / path
    if found.exists():
        return ResolvedData(path=found, name=_name_in_data(found, settings))
    ref = parse_ref(text, settings)
    if ref is not None:
        return resolve_ref(ref, settings)
    name = _name_in_data(found, settings)
    if name is not None:
        md5 = latest_version(text, settings)
        if md5 is not None:
            step_logger(__name__).info(
                "%s %s is not on this machine: using %s@%s = %s from the DVC remote %s",
                what, text, name, LATEST, md5, redact_uri(_remote(settings)),
            )  # fmt: skip
            return resolve_ref(DataRef(name, md5), settings)
    root = os.environ.get("IMAGEOPS_PROJECT_ROOT") or "unset: the working folder"
    raise InvalidParameterError(
        f"The {what} {text} does not exist under the project root {settings.project_root} "
        f"(IMAGEOPS_PROJECT_ROOT: {root})"
        + (
            f", and the DVC remote {redact_uri(_remote(settings))} has no `latest` version of "
            f"{name}."
            if name is not None
            else "."
        ),
        f"Name a data set version instead, as {REF_SYNTAX}: `imageops version` prints it on "
        "the machine that has the data (e.g. digits/train@latest). Or start the Prefect worker "
        "in the project's checkout with IMAGEOPS_PROJECT_ROOT set to it (imageops team join "
        "does both), or give the path from the project root.",
    )


def latest_version(path: str | Path, settings: Settings | None = None) -> str | None:
    """The md5 of the ``latest`` version of the data set at ``path`` (a path under ``data/``,
    from the project root) in the DVC remote; None when it has none or is not under data/."""
    settings = settings or get_settings()
    path = Path(path).expanduser()
    name = _name_in_data(path if path.is_absolute() else settings.project_root / path, settings)
    return None if name is None else _tagged(name, LATEST, settings)


def _name_in_data(path: Path, settings: Settings) -> str | None:
    """``path``'s data set name when it lies under ``data/``, else None."""
    data = settings.data_path.resolve()
    target = path.resolve()
    if not target.is_relative_to(data) or target == data:
        return None
    return dataset_name(target, settings)
