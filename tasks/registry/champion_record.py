"""Which version is ``@champion``, since when and by whose move, as one tag a person reads.

The alias is the truth; the ``champion`` tag on each version that held it says so in words:
``yes, since 2026-11-26 10:00:00 UTC (imageops promote)`` on the current one, ``no: was
@champion from ... to ... (by hand in the MLflow registry); then v3`` on the ones before. Every
move of the alias reaches :func:`reconcile`: the promote step's own (it marks the challenger
``champion.pending`` first, so whichever of it and the webhook receiver gets there first writes
the same record), and a move by hand in MLflow's UI or API through the registry webhook. It
reads the alias as it is now, so webhook deliveries that arrive out of order or twice leave the
same tags. Details: docs/promotion.md#the-champion-tag.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

CHAMPION_TAG = "champion"
PENDING_TAG = "champion.pending"  # set by the promote step before it moves the alias
CHAMPION_ALIAS = "champion"
BY_PROMOTE = "imageops promote"
BY_REGISTER = "imageops register --alias champion"
BY_HAND = "by hand in the MLflow registry"
# A move by hand that no webhook reported (embedded mode: SQLite, no MLflow server), recorded when
# imageops next resolves the alias: "since" is then when it was seen, not when it was made.
BY_HAND_SEEN = "by hand in the MLflow registry; the time imageops first saw it"


def now_text(when: datetime | None = None) -> str:
    """The registry's time format, as people read it: ``2026-11-26 10:00:00 UTC``."""
    return (when or datetime.now(UTC)).strftime("%Y-%m-%d %H:%M:%S UTC")


def reconcile(
    client: MlflowClient,
    name: str,
    alias: str = "champion",
    moved_to: int | None = None,
    by_hand: str = BY_HAND,
) -> int | None:
    """Bring the ``champion`` tags of ``name``'s versions in line with where ``alias`` points
    now; returns that version (None: no version holds it). ``moved_to``: the version an alias
    event named; if the alias has moved on since (two moves in quick succession) and it has no
    record yet, it gets one saying it held the alias briefly. ``by_hand``: how a move no imageops
    step marked as its own is described."""
    from mlflow.exceptions import MlflowException

    try:
        current = int(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        current = None
    stamp = now_text()
    for version in client.search_model_versions(f"name = '{name}'"):
        number, tags = int(version.version), version.tags or {}
        record = tags.get(CHAMPION_TAG, "")
        if number == current and not record.startswith("yes"):
            by = tags.get(PENDING_TAG) or by_hand
            client.set_model_version_tag(
                name, str(number), CHAMPION_TAG, f"yes, since {stamp} ({by})"
            )
        elif number != current and record.startswith("yes"):
            since, _, by = record.removeprefix("yes, since ").partition(" (")
            then = f"; then v{current}" if current is not None else ""
            _set(client, name, number, f"no: was @{alias} from {since} to {stamp} ({by}{then}")
        elif number == moved_to and number != current and not record:
            by = tags.get(PENDING_TAG) or by_hand
            _set(
                client,
                name,
                number,
                f"no: was @{alias} briefly, until {stamp} ({by}); then v{current}",
            )
        if number == current and PENDING_TAG in tags:
            client.delete_model_version_tag(name, str(number), PENDING_TAG)
    return current


def _set(client: MlflowClient, name: str, version: int, record: str) -> None:
    """Set the ``champion`` tag; once more if another writer set it at the same moment (MLflow's
    SQL stores insert a new tag, and two inserts of one key collide)."""
    from mlflow.exceptions import MlflowException

    try:
        client.set_model_version_tag(name, str(version), CHAMPION_TAG, record)
    except MlflowException:
        client.set_model_version_tag(name, str(version), CHAMPION_TAG, record)


def mark_pending(client: MlflowClient, name: str, version: int, by: str = BY_PROMOTE) -> None:
    """Say, before imageops moves the alias, whose move it is (the promote step's, by default)."""
    client.set_model_version_tag(name, str(version), PENDING_TAG, by)
