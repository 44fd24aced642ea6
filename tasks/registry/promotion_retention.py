"""Which promotion work folders may go: those a killed promotion left without its decision.

A promotion (:mod:`tasks.registry.promote`) works in ``<home>/promotions/<time>-v<challenger>``
holding the promotion lock from the folder's creation to its decision, which it writes last
(``promotion.json``). A folder without the decision while no promotion holds the lock is one a kill
cut short: nothing reads it again (the next promotion starts its own), and its scored tables can
be large. A folder with its decision is the record of one and stays.
Details: docs/training.md#disk-space.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from models.locks import acquire, is_held
from tasks.registry.promote import DECISION_FILE, PROMOTIONS_DIR, promotion_lock
from tasks.shared.errors import RegistryError
from tasks.shared.reclaim import Reclaimable, trash
from tasks.shared.settings import Settings

PARTIAL_PROMOTION = "partial promotion"


def partial_promotions(settings: Settings) -> list[Reclaimable]:
    """The promotion folders without a decision, none while a promotion runs."""
    root = settings.home_dir / PROMOTIONS_DIR
    if not root.is_dir() or is_held(promotion_lock(settings)):
        return []
    folders = sorted(
        p
        for p in root.iterdir()
        if p.is_dir()
        and not p.is_symlink()
        and not p.name.startswith(".")  # a trash name: left_trash's
        and not (p / DECISION_FILE).exists()
    )
    return [
        Reclaimable.at(
            PARTIAL_PROMOTION,
            folder,
            f"a promotion stopped before its decision (no {DECISION_FILE})",
            partial(_remove, settings, folder),
        )
        for folder in folders
    ]


def _remove(settings: Settings, folder: Path) -> bool:
    """Remove ``folder`` holding the promotion lock; False (kept) while a promotion runs."""
    try:
        lock = acquire(promotion_lock(settings), 0, RegistryError("A promotion runs."))
    except RegistryError:
        return False
    try:
        trash(folder)
    finally:
        lock.release()
    return True
