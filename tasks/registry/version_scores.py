"""A registered version's Evaluate Model metrics on a labeled ImageDirectory, as its ONNX model
scores them: scored once per content of the images and kept as a tag on the version.

Registration records the exported model's validation figures this way (the version's page then
shows what `imageops score` and `imageops evaluate` of it give, not training's own figure), and
promotion its holdout's; either reuses a record the other made for the same images.
Details: docs/promotion.md#scores-kept-per-holdout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from mlflow.tracking import MlflowClient

from models import strict_json
from tasks.data.imagedir import MANIFEST, ManifestHead
from tasks.data.manifest_stream import content_digest, count_images, read_head
from tasks.inference.evaluate import table_metrics
from tasks.inference.score import score
from tasks.shared.errors import InvalidParameterError
from tasks.shared.step import step_logger

# A version's metrics on one image set: tag SCORES_TAG + the set's content digest. Raise
# SCORES_FORMAT when scoring or the metrics change what they compute: older records are then
# ignored (and replaced), never reused.
SCORES_TAG = "promotion.scores."
SCORES_FORMAT = 1


@dataclass(frozen=True)
class Holdout:
    """A labeled ImageDirectory a version is scored on."""

    path: Path
    digest: str | None  # content_digest: what a recorded score is keyed by
    images: int


def labeled_holdout(path: Path, role: str) -> ManifestHead:
    """The manifest head of the labeled ImageDirectory at ``path`` (``role``: what it is for,
    in messages); raises InvalidParameterError when it is not one."""
    if not (path / MANIFEST).is_file():
        raise InvalidParameterError(
            f"{role} {path} is not an ImageDirectory (no {MANIFEST}).",
            "Pass a converted, labeled data set the model did not train on, e.g. the "
            "validation or test output of the split step.",
        )
    head = read_head(path)
    if not head.labeled:
        raise InvalidParameterError(
            f"{role} {path} is unlabeled: there is no truth to score the model against.",
            "Pass a labeled ImageDirectory (one sub-folder per class).",
        )
    return head


def identify(path: Path, head: ManifestHead) -> Holdout:
    """The image set and its content digest (from its manifest and a stat per image)."""
    digest = content_digest(path, head)
    if digest is None:
        step_logger(__name__).warning(
            "%s: files differ from its %s (edited in place?): the model is scored and no "
            "score is kept; convert the folder again to give it an identity",
            path,
            MANIFEST,
        )
    return Holdout(path, digest, count_images(path))


def recorded_metrics(
    client: MlflowClient, name: str, version: int, holdout: Holdout
) -> dict[str, float] | None:
    """The metrics recorded for ``version`` on this image set's content, or None."""
    if holdout.digest is None:
        return None
    tag = client.get_model_version(name, str(version)).tags.get(SCORES_TAG + holdout.digest)
    try:
        record = json.loads(tag) if tag else {}
        if record.get("format") == SCORES_FORMAT and record.get("holdout_digest") == holdout.digest:
            return {str(k): v for k, v in record["metrics"].items() if v is not None}
    except (ValueError, TypeError, KeyError, AttributeError):
        step_logger(__name__).warning(
            "%s v%d: unreadable score record %s, scoring again", name, version, SCORES_TAG
        )
    return None


def version_metrics(
    client: MlflowClient,
    name: str,
    version: int,
    model_dir: Path,
    holdout: Holdout,
    dest: Path,
    needed: str = "accuracy",
) -> tuple[dict[str, float], bool]:
    """Every Evaluate Model metric of ``version`` on ``holdout``, and whether they were read
    from the version's record rather than scored.

    Scored through ONNX Runtime (the version's ``model.onnx`` in ``model_dir``) into ``dest``
    unless the version already has a record for this content holding ``needed``; a new score is
    recorded on the version in the registry, so every machine of a team reuses it.
    """
    known = recorded_metrics(client, name, version, holdout)
    if known is not None and needed in known:
        step_logger(__name__).info(
            "%s v%d: scores on %s (digest %s) reused from the registry",
            name,
            version,
            holdout.path.name,
            holdout.digest[:12] if holdout.digest else "",
        )
        return known, True
    metrics = dict(table_metrics(score(model_dir, holdout.path, dest)).metrics)
    if holdout.digest is not None:
        record = {
            "format": SCORES_FORMAT,
            "holdout_digest": holdout.digest,
            "images": holdout.images,
            "metrics": metrics,
            "holdout": str(holdout.path.resolve()),
            "time": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        text = strict_json.dumps(record, sort_keys=True)
        client.set_model_version_tag(name, str(version), SCORES_TAG + holdout.digest, text)
    return metrics, False
