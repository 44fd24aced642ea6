"""Where tuning studies live: Optuna storage and each study's folder.

By default each study is a journal file, ``<home>/tuning/<study>.journal``: an append-only log
that several processes (the tune flow, the training workers reporting epochs) write safely, with
no server. At scale, ``IMAGEOPS_TUNING_STORAGE`` names a database (``postgresql://...``) that every
machine reaches; SQLite takes few concurrent writers (DESIGN, known traps), so parallel trials
on one machine are better served by the journal.
"""

from __future__ import annotations

import functools
from pathlib import Path

import optuna
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend

from tasks.shared.settings import Settings

TUNING_DIR = "tuning"
JOURNAL_SUFFIX = ".journal"


def study_dir(settings: Settings, study_name: str) -> Path:
    """The study's folder: one sub-folder per trial (untrained model, trained model), reports."""
    return settings.home_dir / TUNING_DIR / study_name


def storage_ref(settings: Settings, study_name: str) -> str | None:
    """The study's journal file, or None for the database of ``settings.tuning_storage``.

    The database URL may hold a password, so it is never written into a run's configuration:
    a worker reads it from its environment (:meth:`Settings.environment`).
    """
    if settings.tuning_storage:
        return None
    return str(settings.home_dir / TUNING_DIR / f"{study_name}{JOURNAL_SUFFIX}")


def open_storage(ref: str | None, settings: Settings | None = None) -> BaseStorage:
    """The Optuna storage of ``ref`` (a journal file), or of the settings' database when None.

    One storage object per process and place: it caches what it read, and a journal storage
    is thread-safe, so the flow and its trial threads share it.
    """
    if ref is None:
        url = (settings or Settings()).tuning_storage
        if not url:
            raise ValueError("No tuning storage: no journal file given and no database set.")
        return _database(url)
    return _journal(str(Path(ref).resolve()))


def describe_storage(ref: str | None) -> str:
    """Where the study lives, for messages (a database URL is not shown: it may hold a secret)."""
    return ref if ref is not None else "the database of IMAGEOPS_TUNING_STORAGE"


@functools.cache
def _journal(path: str) -> BaseStorage:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(path))


@functools.cache
def _database(url: str) -> BaseStorage:
    # pre-ping: a pooled connection a database server closed is replaced, not failed on.
    return RDBStorage(url, engine_kwargs={"pool_pre_ping": True})


def quiet_optuna() -> None:
    """Optuna logs every trial at INFO; our own logs say it once, in the run's words."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
