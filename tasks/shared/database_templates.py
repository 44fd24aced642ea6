"""Migrated, empty SQLite databases kept per library version, so a new project starts from a copy.

Creating Prefect's or MLflow's database runs every migration of the library: seconds of CPU for
each new project (MLflow: 2.5 s of 4 here; Prefect: 5 to 18 s). The first project on a machine
migrates its own and leaves a copy under ``~/.cache/imageops``; the next ones copy that. A copy
is only ever made from, and put in place of, a file no one else writes (the callers hold the
database's creation lock), and always atomically.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path


def template(library: str) -> Path:
    """Where a freshly migrated, empty database of this version of ``library`` is kept."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "imageops"
    return cache / f"{library}-{version(library)}-empty.db"


def copy_atomically(copy: Callable[[Path], object], dest: Path) -> None:
    """``copy(tmp)`` writes a temporary file beside ``dest``, which then replaces ``dest``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        copy(tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def backup(source: Path, dest: Path) -> None:
    """A consistent copy of a live SQLite database (a server may be writing to it)."""
    live, copy = sqlite3.connect(source), sqlite3.connect(dest)
    try:
        live.backup(copy)
    finally:
        copy.close()
        live.close()


def seed(library: str, database: Path) -> None:
    """A server about to create ``database`` (``prefect server start``, ``mlflow server``) finds
    the migrated template there instead, when there is one."""
    made = template(library)
    if not database.exists() and made.is_file():
        copy_atomically(lambda tmp: shutil.copyfile(made, tmp), database)


@contextmanager
def mlflow_database(database: Path) -> Iterator[None]:
    """Around MLflow's first use of the SQLite file ``database`` (the caller holds its lock):
    a new one starts as a copy of the template, or, with none yet, becomes the template.

    The template lacks MLflow's Default experiment, whose artifact location names the project
    it was made in: MLflow makes it again, for this project, when it opens the copy.
    """
    made = template("mlflow")
    new = not database.exists()
    if new and made.is_file():
        seed("mlflow", database)
        new = False
    yield
    if new and database.is_file() and not made.exists():
        # On failure there is no cache this time: the next new project migrates its own.
        with contextlib.suppress(OSError, sqlite3.Error):
            copy_atomically(lambda tmp: _without_default_experiment(database, tmp), made)


def _without_default_experiment(database: Path, tmp: Path) -> None:
    backup(database, tmp)
    copy = sqlite3.connect(tmp)
    try:
        with copy:
            copy.execute("DELETE FROM experiment_tags WHERE experiment_id = 0")
            copy.execute("DELETE FROM experiments WHERE experiment_id = 0")
            if copy.execute("SELECT count(*) FROM experiments").fetchone()[0]:
                raise sqlite3.DatabaseError("not empty: it holds experiments of its own")
    finally:
        copy.close()
