"""Which version is ``@champion``, since when and by whose move, as tags a person reads.

The alias is the truth; the tags on each version that held it say so in words: ``champion``, a
word or two the registry's version list shows whole (``yes`` on the current one, ``before v3`` on
one that held it before v3), and ``champion.record``, the details on the version's page: ``yes,
since 2026-11-26 10:00:00 UTC (imageops promote)``, ``no: was @champion from ... to ... (by hand
in the MLflow registry); then v3``. Every
move of the alias reaches :func:`reconcile`: the promote step's own (it marks the challenger
``champion.pending`` first, so whichever of it and the webhook receiver gets there first writes
the same record), and a move by hand in MLflow's UI or API through the registry webhook. The
times and versions come from the events that moved the alias, so webhook deliveries that arrive
out of order or twice leave the same tags. Details: docs/promotion.md#the-champion-tag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

CHAMPION_TAG = "champion"  # yes, before v3, was: what the version list shows
RECORD_TAG = "champion.record"  # since when, until when, by whose move: the version's page
PENDING_TAG = "champion.pending"  # set by the promote step before it moves the alias
CHAMPION_ALIAS = "champion"
BY_PROMOTE = "imageops promote"
BY_REGISTER = "imageops register --alias champion"
BY_HAND = "by hand in the MLflow registry"
# A move by hand that no webhook reported (embedded mode: SQLite, no MLflow server), recorded when
# imageops next resolves the alias: "since" is then when it was seen, not when it was made.
SEEN = "; the time imageops first saw it"  # a record whose time is when imageops saw the move
BY_HAND_SEEN = BY_HAND + SEEN


def now_text(when: datetime | None = None) -> str:
    """The registry's time format, as people read it: ``2026-11-26 10:00:00 UTC``."""
    return (when or datetime.now(UTC)).strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclass(frozen=True)
class _Hold:
    """A version's latest time as holder of the alias, as its ``champion`` tag records it."""

    since: datetime
    by: str

    @property
    def seen(self) -> bool:
        """Whether ``since`` is when imageops saw the move, not the move's own time."""
        return self.by.endswith(SEEN)


_YES = re.compile(r"^yes, since (.+? UTC) \((.*)\)$")
_WAS = re.compile(r"^no: was @\S+ from (.+? UTC)(?: to .+? UTC)? \((.*)\)(?:; then v\d+)?$")


def _hold(record: str) -> _Hold | None:
    """The hold a ``champion`` tag records (None: never held, or held too briefly to know when
    it began: the old ``briefly, until`` records)."""
    found = _YES.match(record) or _WAS.match(record)
    if found is None:
        return None
    try:
        since = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S UTC").replace(tzinfo=UTC)
    except ValueError:
        return None
    return _Hold(since, found.group(2))


def reconcile(
    client: MlflowClient,
    name: str,
    alias: str = "champion",
    moved_to: int | None = None,
    by_hand: str = BY_HAND,
    at: datetime | None = None,
) -> int | None:
    """Bring the ``champion`` tags of ``name``'s versions in line with the moves of ``alias``;
    returns the version it points to now (None: none).

    ``moved_to`` and ``at``: the move an alias event reports, its version and time (MLflow's
    delivery time; the promote step's own). The tags are the alias's history, each version's
    latest time as holder: a version held it from its move until the next holder's move, "then
    vN". So two quick moves leave each version the times of the events that moved the alias,
    whatever order their deliveries arrive in, and a delivery repeated changes nothing. The
    version the alias points to now, if no event of its move has come yet, is recorded as seen
    now (``...; the time imageops first saw it``) until its event gives the move's own time.
    ``by_hand``: how a move no imageops step marked as its own is described.
    """
    from mlflow.exceptions import MlflowException

    try:
        current = int(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        current = None
    versions = {
        int(v.version): v.tags or {} for v in client.search_model_versions(f"name = '{name}'")
    }
    holds = {n: h for n, tags in versions.items() if (h := _hold(_record_of(tags)))}

    def by_of(number: int, same: _Hold | None = None) -> str:
        """Whose move gave ``number`` the alias: the promote step's mark, else the record of
        this same hold (``same``), else ``by_hand``."""
        mark = versions.get(number, {}).get(PENDING_TAG)
        return mark or (same.by if same else by_hand).removesuffix(SEEN)

    if moved_to is not None and moved_to in versions:
        when = (at or datetime.now(UTC)).replace(microsecond=0)
        kept = holds.get(moved_to)
        others = max((h.since for n, h in holds.items() if n != moved_to), default=None)
        if kept is None or kept.seen:  # its first record, or the event of a move seen before
            holds[moved_to] = _Hold(when, by_of(moved_to, kept))
        # A later hold of it that has ended since, or it took the alias back after another.
        elif (moved_to != current and kept.since < when) or (
            others is not None and kept.since < others <= when
        ):
            holds[moved_to] = _Hold(when, by_of(moved_to))
    if current is not None:
        kept = holds.get(current)
        latest = max((h.since for n, h in holds.items() if n != current), default=None)
        if kept is None or (latest is not None and kept.since < latest):
            # The event of its move has not come yet (or it took the alias back since): seen now.
            now = datetime.now(UTC).replace(microsecond=0)
            holds[current] = _Hold(max(now, latest or now), by_of(current) + SEEN)
    order = sorted(holds, key=lambda n: (holds[n].since, n == current, n))
    for place, number in enumerate(order):
        hold = holds[number]
        since = now_text(hold.since)
        if number == current:
            record = f"yes, since {since} ({hold.by})"
        else:
            after = order[place + 1] if place + 1 < len(order) else current
            until = f" to {now_text(holds[after].since)}" if after in holds else ""
            then = f"; then v{after}" if after is not None else ""
            record = f"no: was @{alias} from {since}{until} ({hold.by}){then}"
        short = "yes" if number == current else _former(order, place, current)
        tags = versions[number]
        if tags.get(RECORD_TAG) != record or tags.get(CHAMPION_TAG) != short:
            _set(client, name, number, {CHAMPION_TAG: short, RECORD_TAG: record})
    if current is not None and PENDING_TAG in versions.get(current, {}):
        client.delete_model_version_tag(name, str(current), PENDING_TAG)
    return current


def _former(order: list[int], place: int, current: int | None) -> str:
    """The short tag of a version that held the alias before: ``before v3``, the version that
    took it next; ``was`` when none holds it now."""
    after = order[place + 1] if place + 1 < len(order) else current
    return f"before v{after}" if after is not None else "was"


def _record_of(tags: dict[str, str]) -> str:
    """A version's record: ``champion.record``; a registry written before it was split off
    kept the whole sentence in ``champion``."""
    return tags.get(RECORD_TAG) or tags.get(CHAMPION_TAG, "")


def _set(client: MlflowClient, name: str, version: int, tags: dict[str, str]) -> None:
    """Set the short tag, then the record (the version list shows tags in the order they were
    first set); each once more if another writer set it at the same moment (MLflow's SQL stores
    insert a new tag, and two inserts of one key collide)."""
    from mlflow.exceptions import MlflowException

    for key, value in tags.items():
        try:
            client.set_model_version_tag(name, str(version), key, value)
        except MlflowException:
            client.set_model_version_tag(name, str(version), key, value)


def mark_pending(client: MlflowClient, name: str, version: int, by: str = BY_PROMOTE) -> None:
    """Say, before imageops moves the alias, whose move it is (the promote step's, by default)."""
    client.set_model_version_tag(name, str(version), PENDING_TAG, by)
