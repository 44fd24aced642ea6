"""Promote a model: the challenger takes the ``champion`` alias only by beating it on held-out data.

Both versions' ONNX models (what batch scoring runs) are scored on the same held-out images and
compared on one Evaluate Model metric, with a ``margin``; the decision and both scores become
registry tags, so the registry says why the alias sits where it does. A version's metrics on a
holdout are kept as a tag on the version, keyed by the holdout's content digest, so the champion
is scored once per holdout version, not on every promotion. Moving ``champion`` starts the next
batch scoring. Details: docs/promotion.md#promotion.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from models import strict_json
from models.atomic import write_json
from models.directory import read_model_info
from tasks.data.imagedir import ManifestHead
from tasks.inference.evaluate import SUMMARY_ROWS
from tasks.registry.champion_record import mark_pending, now_text, reconcile
from tasks.registry.register import check_alias
from tasks.registry.version_scores import Holdout, identify, labeled_holdout, version_metrics
from tasks.shared.errors import InvalidParameterError, RegistryError
from tasks.shared.project_lock import taking_turns
from tasks.shared.settings import Settings, get_settings
from tasks.shared.step import step, step_logger, tasks_on_first_use

CHAMPION = "champion"
CHALLENGER = "challenger"
TAG_PREFIX = "promotion."
PROMOTION_TAG = "promotion"  # promoted, not promoted: what the version list shows
RECORD_TAG = TAG_PREFIX + "record"  # the decision in one sentence: the version's page
DETAILS_TAG = TAG_PREFIX + "details"  # every field of the decision, JSON
METRICS = tuple(SUMMARY_ROWS)  # all "higher is better"
LOCK_TIMEOUT_S = 1800.0  # other promotions scoring a large holdout first
# Each decision's work folder, <home>/promotions/<time>-v<challenger>: complete once it holds
# DECISION_FILE; one without it and without a promotion running is one a kill cut short.
PROMOTIONS_DIR = "promotions"
DECISION_FILE = "promotion.json"


@dataclass(frozen=True)
class Promotion:
    """What the comparison found and what was done about it."""

    name: str
    challenger_version: int
    champion_version: int | None  # the champion before this decision (None: there was none)
    metric: str
    challenger_score: float
    champion_score: float | None
    margin: float
    promoted: bool
    reason: str
    holdout: str
    # The holdout's content digest (None: its files no longer match its manifest, so no score
    # was reused or kept), and whether each score was read from the version's record instead.
    holdout_digest: str | None = None
    challenger_score_reused: bool = False
    champion_score_reused: bool = False


def _version(client: MlflowClient, name: str, candidate: str | int) -> int:
    """The version number ``candidate`` names: a number, or an alias of ``name``."""
    try:
        if isinstance(candidate, int) or str(candidate).isdigit():
            return int(client.get_model_version(name, str(candidate)).version)
        return int(client.get_model_version_by_alias(name, str(candidate)).version)
    except MlflowException as exc:
        hint = (
            f"Register a model first (imageops register, or run the pipeline), with alias "
            f"{CHALLENGER!r} for the one to promote, or pass its version number."
        )
        try:  # the model exists, only the alias or version is wrong: say what there is
            aliases = client.get_registered_model(name).aliases
            known = ", ".join(f"@{a} -> v{v}" for a, v in sorted(aliases.items())) or "none"
            hint = f"Its aliases: {known}. Pass one of them or a version number."
        except MlflowException:
            pass
        raise RegistryError(
            f"Registered model {name!r} has no version {candidate!r}: {exc.message}", hint
        ) from exc


def _champion(client: MlflowClient, name: str) -> int | None:
    """The champion's version, or None: read from the model's aliases, not guessed from an error."""
    version = client.get_registered_model(name).aliases.get(CHAMPION)
    return None if version is None else int(version)


def _version_dir(name: str, version: int, settings: Settings, using: ExitStack) -> Path:
    """The registered version's ModelDirectory (fetched into the registry cache once), leased
    until ``using`` closes: ``imageops gc`` leaves it while the promotion scores with it."""
    from tasks.registry.model_uri import model_in_use

    return using.enter_context(model_in_use(f"models:/{name}/{version}", settings))


def _check(holdout: Path, metric: str, margin: float) -> ManifestHead:
    """The holdout's manifest, once the parameters are known to be sound."""
    if metric not in METRICS:
        raise InvalidParameterError(
            f"metric must be one of {', '.join(METRICS)}, got {metric!r}.",
            "Pick the Evaluate Model metric that decides promotion (default accuracy).",
        )
    if not 0.0 <= margin < 1.0:
        raise InvalidParameterError(
            f"margin must be in [0, 1), got {margin}.",
            "The margin is in the metric's own units: 0.01 is one point of accuracy.",
        )
    return labeled_holdout(holdout, "holdout")


def promote(
    holdout: Path,
    *,
    candidate: str | int = CHALLENGER,
    metric: str = "accuracy",
    margin: float = 0.0,
    settings: Settings | None = None,
) -> Promotion:
    """Compare ``candidate`` (an alias or version number) with the champion on ``holdout``.

    The candidate becomes ``champion`` when there is none, or when its ``metric`` exceeds the
    champion's by more than ``margin``. Returns the decision, also recorded as ``promotion.*``
    tags on the versions and as ``promotion.json`` in this step's work folder. Raises
    InvalidParameterError for a bad metric, margin or holdout, and RegistryError when the
    candidate does not exist.
    """
    settings = settings or get_settings()
    holdout = Path(holdout)
    held = identify(holdout, _check(holdout, metric, margin))
    if isinstance(candidate, str) and not candidate.isdigit():
        check_alias(candidate)
    name = settings.registered_model_name
    client = MlflowClient(settings.tracking_uri, settings.registry_uri)
    challenger = _version(client, name, candidate)
    with _one_decision_at_a_time(settings), ExitStack() as using:
        return _decide(client, settings, held, challenger, metric, margin, using)


def promotion_lock(settings: Settings) -> Path:
    """The lock file a promotion holds from its first step to its decision (and gc to remove
    what a killed one left)."""
    return settings.home_dir / "locks" / "promote.lock"


def _one_decision_at_a_time(settings: Settings) -> AbstractContextManager[None]:
    """Two runs promoting at once would both find no champion (or both beat the old one) and
    the last to write would win: each decision starts from the champion the previous one left."""
    return taking_turns(
        promotion_lock(settings),
        LOCK_TIMEOUT_S,
        RegistryError,
        "another promotion in this project",
        "Check for a stuck `imageops` process (it holds the lock) and stop it, then promote again.",
    )


def _decide(
    client: MlflowClient,
    settings: Settings,
    held: Holdout,
    challenger: int,
    metric: str,
    margin: float,
    using: ExitStack,
) -> Promotion:
    """Score, compare and move the alias: the part of :func:`promote` that runs alone; the
    versions' cache folders are leased until ``using`` closes."""
    log = step_logger(__name__)
    name = settings.registered_model_name
    champion = _champion(client, name)
    now = datetime.now(UTC)
    work = settings.home_dir / PROMOTIONS_DIR / f"{now:%Y%m%d-%H%M%S-%f}-v{challenger}"
    work.mkdir(parents=True, exist_ok=True)

    challenger_dir = _version_dir(name, challenger, settings, using)
    # Every metric of each version on the holdout, scored through its ONNX model or read from
    # the version's record of these images (tasks.registry.version_scores).
    scores, challenger_reused = version_metrics(
        client, name, challenger, challenger_dir, held, work / f"v{challenger}.csv", metric
    )
    challenger_score = float(scores[metric])
    champion_dir = _version_dir(name, champion, settings, using) if champion else None
    champion_score, champion_reused = None, False
    if champion is None:
        promoted, reason = True, "first model: there was no champion"
    elif champion == challenger:
        promoted, reason = False, f"version {challenger} is already the champion"
        champion_score, champion_reused = challenger_score, challenger_reused
    elif (theirs := read_model_info(champion_dir).classes) != (
        ours := read_model_info(challenger_dir).classes
    ):
        # A model of another data set would score nothing on this holdout and always lose (or,
        # as champion, always be replaced): the two are not rivals.
        promoted = False
        reason = (
            f"champion v{champion} classifies other classes ({', '.join(theirs)}) than "
            f"v{challenger} ({', '.join(ours)}): not comparable; give each data set its own "
            "registered model (IMAGEOPS_REGISTERED_MODEL_NAME)"
        )
    else:
        scores, champion_reused = version_metrics(
            client, name, champion, champion_dir, held, work / f"v{champion}.csv", metric
        )
        champion_score = float(scores[metric])
        gain = challenger_score - champion_score
        promoted = gain > margin
        reason = (
            f"v{challenger} {metric} {challenger_score:.4f} vs champion v{champion} "
            f"{champion_score:.4f}: "
            f"{'+' if gain >= 0 else ''}{gain:.4f}, "
            f"{'more' if promoted else 'not more'} than the margin {margin:g}"
        )
    decision = Promotion(
        name=name,
        challenger_version=challenger,
        champion_version=champion,
        metric=metric,
        challenger_score=challenger_score,
        champion_score=champion_score,
        margin=margin,
        promoted=promoted,
        reason=reason,
        holdout=str(held.path.resolve()),
        holdout_digest=held.digest,
        challenger_score_reused=challenger_reused,
        champion_score_reused=champion_reused,
    )
    _record(client, decision, now)
    write_json(work / DECISION_FILE, asdict(decision))
    if promoted:
        mark_pending(client, name, challenger)  # the webhook receiver may reconcile first
        client.set_registered_model_alias(name, CHAMPION, str(challenger))
        reconcile(client, name, CHAMPION, moved_to=challenger, at=datetime.now(UTC))
        _announce(settings, name, challenger)
    log.info(
        "%s v%d %s: %s",
        name,
        challenger,
        "is the new champion" if promoted else "stays challenger",
        reason,
    )
    return decision


def _record(client: MlflowClient, decision: Promotion, now: datetime) -> None:
    """The decision on the challenger: in a word or two (``promotion``: promoted, not promoted)
    for the registry's version list, in one sentence (``promotion.record``) and as JSON
    (``promotion.details``) for its page; on the champion, one sentence of what happened to it.

    The champion keeps the record of the decision that made it champion: a challenger's loss is
    written on the challenger, and the champion gets ``promotion.defended`` (or, when beaten,
    ``promotion.replaced``) beside its own record, never over it.
    """
    if decision.champion_version == decision.challenger_version:
        return  # already champion (a second promotion of it): the record that made it so stays
    verdict = "promoted to @champion" if decision.promoted else "not promoted"
    stamp = now_text(now)  # as the champion tags write it; ISO in the JSON
    time = now.isoformat(timespec="seconds")
    details = {**asdict(decision), "time": time, "scores_reused": reused_versions(decision)}
    _set_tags(
        client,
        decision.name,
        decision.challenger_version,
        {
            PROMOTION_TAG: "promoted" if decision.promoted else "not promoted",
            RECORD_TAG: f"{verdict} {stamp}: {decision.reason}",
            DETAILS_TAG: strict_json.dumps(details),
        },
    )
    champion = decision.champion_version
    if champion is None:
        return
    if decision.promoted:
        against = {TAG_PREFIX + "replaced": f"{stamp}: v{decision.challenger_version} won, "
                   f"{decision.reason}"}  # fmt: skip
    else:
        against = {TAG_PREFIX + "defended": f"{stamp}: against v{decision.challenger_version}, "
                   f"{decision.reason}"}  # fmt: skip
    _set_tags(client, decision.name, champion, against)


def reused_versions(decision: Promotion) -> list[int]:
    """The versions whose score came from their record on this holdout, not from scoring."""
    pairs = (
        (decision.challenger_version, decision.challenger_score_reused),
        (decision.champion_version, decision.champion_score_reused),
    )
    return sorted({v for v, reused in pairs if reused and v is not None})


def _set_tags(client: MlflowClient, name: str, version: int, tags: dict[str, str]) -> None:
    for key, value in tags.items():
        client.set_model_version_tag(name, str(version), key, value)


def _announce(settings: Settings, name: str, version: int) -> None:
    """Emit the alias event where no MLflow server (and so no webhook) will."""
    if settings.registry_uri.startswith(("http://", "https://")):
        step_logger(__name__).info("The MLflow server's webhook announces %s@%s", name, CHAMPION)
        return
    from tasks.registry.promotion_events import emit_alias_event

    emit_alias_event(name, CHAMPION, version)


__getattr__ = tasks_on_first_use(
    globals(),
    promote_task=lambda: step(promote, name="promote"),
)
