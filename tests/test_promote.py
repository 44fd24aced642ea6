"""Promotion on a real MLflow registry (SQLite): champion only for a challenger that wins.

The two models are resnet18s whose head always answers one class ("0" or "1"), so their scores on
a held-out set are known exactly: on a holdout of three 0s and one 1, the "always 0" model scores
accuracy 0.75 and the "always 1" model 0.25. Scoring goes through each version's ONNX model as
downloaded from the registry, as in production.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from model_helpers import make_model_dir

from models.directory import load_model_directory, save_model_directory
from tasks.data.convert import convert
from tasks.data.imagedir import read_manifest, write_manifest
from tasks.data.manifest_stream import content_digest
from tasks.inference.export import export_onnx
from tasks.registry.promote import CHALLENGER, CHAMPION, promote
from tasks.registry.register import register
from tasks.registry.version_scores import SCORES_TAG
from tasks.shared.errors import InvalidParameterError, RegistryError
from tasks.shared.settings import Settings

pytest_plugins = ["model_fixtures"]

NAME = "imageops-classifier"

REGISTRY_TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"  # 2026-11-26 10:00:00 UTC


def _always(answer: int, classes: list[str], dest: Path, val: Path) -> Path:
    """An exported model whose logits always favour class ``answer`` by far."""
    make_model_dir(dest, classes, seed=answer)
    model, info = load_model_directory(dest)
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.fill_(0.0)
        model.fc.bias[answer] = 10.0
    save_model_directory(dest, model, info)
    export_onnx(dest, sample=val)
    return dest


@pytest.fixture(scope="module")
def always(
    tmp_path_factory: pytest.TempPathFactory,
    digits_split: tuple[Path, Path],
    model_classes: list[str],
) -> dict[str, Path]:
    """Class name -> an exported model that always predicts it. Do not modify."""
    root = tmp_path_factory.mktemp("always")
    return {
        model_classes[i]: _always(i, model_classes, root / f"always{i}", digits_split[1])
        for i in (0, 1)
    }


def _holdout(root: Path, digits_raw: Path, skip: int = 0) -> Path:
    """A labeled ImageDirectory of three 0s and one 1; ``skip`` picks other scans of the 0s."""
    for digit, count in (("0", 3), ("1", 1)):
        (root / "raw" / digit).mkdir(parents=True)
        first = skip if digit == "0" else 0
        for path in sorted((digits_raw / digit).glob("*.png"))[first : first + count]:
            shutil.copyfile(path, root / "raw" / digit / path.name)
    convert(root / "raw", root / "images")
    return root / "images"


@pytest.fixture(scope="module")
def holdout(tmp_path_factory: pytest.TempPathFactory, digits_raw: Path) -> Path:
    """A labeled ImageDirectory of three 0s and one 1. Do not modify."""
    return _holdout(tmp_path_factory.mktemp("holdout"), digits_raw)


def _alias(alias: str) -> int:
    return int(MlflowClient().get_model_version_by_alias(NAME, alias).version)


def test_the_first_model_becomes_champion(
    project: Settings, always: dict[str, Path], holdout: Path
) -> None:
    register(always["1"], settings=project, alias=CHALLENGER)

    decision = promote(holdout, settings=project)

    assert decision.promoted and decision.champion_version is None
    assert decision.challenger_score == pytest.approx(0.25)
    assert _alias(CHAMPION) == 1
    tags = MlflowClient().get_model_version(NAME, "1").tags
    # A word or two in the version list; the sentence and the JSON on the version's page.
    assert (tags["promotion"], tags["champion"]) == ("promoted", "yes")
    assert tags["promotion.record"].startswith("promoted to @champion ")
    assert "no champion" in tags["promotion.record"]
    assert json.loads(tags["promotion.details"])["challenger_score"] == pytest.approx(0.25)
    assert tags["champion.record"].startswith("yes, since ")
    assert tags["champion.record"].endswith("(imageops promote)")
    assert "champion.pending" not in tags


def test_a_better_challenger_takes_the_alias_and_a_worse_one_does_not(
    project: Settings, always: dict[str, Path], holdout: Path
) -> None:
    register(always["1"], settings=project, alias=CHAMPION)  # v1: 0.25 on the holdout
    register(always["0"], settings=project, alias=CHALLENGER)  # v2: 0.75

    decision = promote(holdout, settings=project, margin=0.4)

    assert decision.promoted
    assert (decision.challenger_version, decision.champion_version) == (2, 1)
    assert decision.challenger_score == pytest.approx(0.75)
    assert decision.champion_score == pytest.approx(0.25)
    assert _alias(CHAMPION) == 2
    client = MlflowClient()
    tags = client.get_model_version(NAME, "2").tags  # the winner says why, with both scores
    # The time as docs/promotion.md and the champion tag write it, not a folder's stamp.
    record = tags["promotion.record"]
    assert re.match(rf"promoted to @champion {REGISTRY_TIME}: v2 accuracy ", record)
    assert "0.7500 vs champion v1 0.2500" in record
    details = json.loads(tags["promotion.details"])
    assert (details["challenger_score"], details["champion_score"]) == pytest.approx((0.75, 0.25))
    assert details["holdout"] == str(holdout.resolve())
    first = client.get_model_version(NAME, "1").tags
    assert "v2 won" in first["promotion.replaced"]
    assert first["champion"] == "before v2"
    assert first["champion.record"].startswith("no: was @champion from ")
    assert first["champion.record"].endswith("(imageops register --alias champion); then v2")

    # Version 1 again, now as the candidate against champion v2: it loses, nothing moves.
    again = promote(holdout, candidate=1, settings=project)

    assert not again.promoted
    assert "not more than the margin" in again.reason
    assert _alias(CHAMPION) == 2
    assert client.get_model_version(NAME, "1").tags["promotion"] == "not promoted"
    assert client.get_model_version(NAME, "1").tags["promotion.record"].startswith("not promoted ")
    # the champion's own record stands; the defence is written beside it
    champion = client.get_model_version(NAME, "2").tags
    assert champion["promotion"] == "promoted"
    assert champion["promotion.record"].startswith("promoted to @champion ")
    assert json.loads(champion["promotion.details"])["challenger_score"] == pytest.approx(0.75)
    assert "against v1, " in champion["promotion.defended"]
    assert "not more than the margin" in champion["promotion.defended"]
    assert champion["champion"] == "yes"


def test_a_move_by_hand_leaves_true_champion_tags_on_both_versions(
    project: Settings, always: dict[str, Path], holdout: Path
) -> None:
    """A person moves @champion in the registry (the webhook receiver then reconciles, with the
    move's version and time): the version that lost it says so, and the one that got it says it
    was by hand. Two quick moves whose deliveries come in reverse order leave each version the
    times of the events that moved the alias (issue 47, finding 8: v1 said it lost the alias to
    v3, at v3's time, when v2 had taken it first)."""
    from tasks.registry.champion_record import now_text, reconcile

    register(always["1"], settings=project, alias=CHALLENGER)
    promote(holdout, settings=project)  # v1 champion by the promote step
    register(always["0"], settings=project)  # v2
    client = MlflowClient()
    since = client.get_model_version(NAME, "1").tags["champion.record"]
    moved = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=5)  # MLflow's clock
    client.set_registered_model_alias(NAME, CHAMPION, "2")  # by hand
    assert reconcile(client, NAME, moved_to=2, at=moved) == 2
    assert reconcile(client, NAME, moved_to=2, at=moved) == 2  # a re-delivery changes nothing
    one, two = (client.get_model_version(NAME, v).tags for v in ("1", "2"))
    held = since.removeprefix("yes, since ").removesuffix(" (imageops promote)")
    assert one["champion.record"] == (
        f"no: was @champion from {held} to {now_text(moved)} (imageops promote); then v2"
    )
    assert two["champion.record"] == (
        f"yes, since {now_text(moved)} (by hand in the MLflow registry)"
    )
    assert (one["champion"], two["champion"]) == ("before v2", "yes")
    assert "promotion" not in two  # no decision of ours made it champion, and none claims to

    # Two moves 2 s apart (v3, then v1 again); the receiver hears of the second first.
    register(always["0"], settings=project)  # v3
    client.set_registered_model_alias(NAME, CHAMPION, "3")
    client.set_registered_model_alias(NAME, CHAMPION, "1")
    to_three, to_one = moved + timedelta(seconds=60), moved + timedelta(seconds=62)

    def tags() -> dict[str, str]:
        return {v: client.get_model_version(NAME, v).tags.get("champion.record", "") for v in "123"}

    assert reconcile(client, NAME, moved_to=1, at=to_one) == 1
    assert tags()["1"] == f"yes, since {now_text(to_one)} (by hand in the MLflow registry)"
    for version, at in ((3, to_three), (1, to_one), (3, to_three)):  # the first, then both again
        assert reconcile(client, NAME, moved_to=version, at=at) == 1
    by_hand = "by hand in the MLflow registry"
    assert tags() == {
        "2": f"no: was @champion from {now_text(moved)} to {now_text(to_three)} "
        f"({by_hand}); then v3",
        "3": f"no: was @champion from {now_text(to_three)} to {now_text(to_one)} ({by_hand}); "
        "then v1",
        "1": f"yes, since {now_text(to_one)} ({by_hand})",
    }
    shown = {v: client.get_model_version(NAME, v).tags["champion"] for v in "123"}
    assert shown == {"2": "before v3", "3": "before v1", "1": "yes"}  # the version list's


def test_a_registry_with_the_old_one_tag_records_keeps_their_times(
    project: Settings, always: dict[str, Path]
) -> None:
    """Registries written before the short tags kept the whole sentence in ``champion``: the
    next move reads the hold from there, and writes the word and the record apart."""
    from tasks.registry.champion_record import reconcile

    register(always["1"], settings=project)
    register(always["0"], settings=project)
    client = MlflowClient()
    client.set_registered_model_alias(NAME, CHAMPION, "1")
    old = "yes, since 2026-11-01 09:00:00 UTC (imageops promote)"
    client.set_model_version_tag(NAME, "1", "champion", old)
    client.set_registered_model_alias(NAME, CHAMPION, "2")
    moved = datetime(2026, 11, 2, 9, 0, tzinfo=UTC)

    assert reconcile(client, NAME, moved_to=2, at=moved) == 2

    one = client.get_model_version(NAME, "1").tags
    assert one["champion"] == "before v2"
    assert one["champion.record"] == (
        "no: was @champion from 2026-11-01 09:00:00 UTC to 2026-11-02 09:00:00 UTC "
        "(imageops promote); then v2"
    )


def test_a_win_smaller_than_the_margin_leaves_the_champion(
    project: Settings, always: dict[str, Path], holdout: Path
) -> None:
    register(always["1"], settings=project, alias=CHAMPION)
    register(always["0"], settings=project, alias=CHALLENGER)

    decision = promote(holdout, settings=project, margin=0.6)  # wins by 0.5

    assert not decision.promoted
    assert _alias(CHAMPION) == 1
    assert _alias(CHALLENGER) == 2
    record = sorted((project.home_dir / "promotions").glob("*/promotion.json"))
    assert json.loads(record[-1].read_text())["promoted"] is False


def test_the_champion_against_itself_stays_and_keeps_its_record(
    project: Settings, always: dict[str, Path], holdout: Path
) -> None:
    """Two promotions of one challenger at once (they take turns): the second finds it already
    champion, and the record of why it is champion is not replaced by "not promoted"."""
    register(always["0"], settings=project, alias=CHALLENGER)
    assert promote(holdout, settings=project).promoted
    record = MlflowClient().get_model_version(NAME, "1").tags

    decision = promote(holdout, settings=project)

    assert not decision.promoted
    assert "already the champion" in decision.reason
    tags = MlflowClient().get_model_version(NAME, "1").tags
    assert tags["promotion"] == "promoted"
    assert tags["promotion.record"].startswith("promoted to @champion ")
    assert {k: tags[k] for k in record} == record


def _work_folder(project: Settings, challenger: int) -> Path:
    """The newest promotion's work folder (where the versions it scored leave their tables)."""
    return sorted((project.home_dir / "promotions").glob(f"*-v{challenger}"))[-1]


@pytest.mark.slow  # three promotions
def test_the_champion_is_scored_once_per_holdout_version(
    project: Settings, always: dict[str, Path], holdout: Path, digits_raw: Path, tmp_path: Path
) -> None:
    register(always["1"], settings=project, alias=CHAMPION)  # v1: 0.25 on the holdout
    register(always["0"], settings=project, alias=CHALLENGER)  # v2: 0.75
    first = promote(holdout, settings=project, margin=0.6)  # not enough: v1 stays champion
    assert not first.champion_score_reused and not first.challenger_score_reused
    assert (_work_folder(project, 2) / "v1.csv").is_file()  # the champion was scored
    client = MlflowClient()
    record = json.loads(client.get_model_version(NAME, "1").tags[SCORES_TAG + first.holdout_digest])
    assert record["metrics"]["accuracy"] == pytest.approx(0.25)
    assert record["images"] == 4

    # The next challenger, same holdout: the champion's score is read from its record.
    register(always["0"], settings=project, alias=CHALLENGER)  # v3
    second = promote(holdout, settings=project, margin=0.6, metric="f1_macro")

    assert second.champion_score_reused and not second.challenger_score_reused
    assert second.holdout_digest == first.holdout_digest
    assert second.champion_score == pytest.approx(record["metrics"]["f1_macro"])
    assert not (_work_folder(project, 3) / "v1.csv").exists()
    assert (_work_folder(project, 3) / "v3.csv").is_file()
    assert json.loads(client.get_model_version(NAME, "3").tags["promotion.details"])[
        "scores_reused"
    ] == [1]

    # One 0 replaced by another scan: another holdout version, so the champion is scored again.
    changed = _holdout(tmp_path / "changed", digits_raw, skip=1)
    third = promote(changed, candidate=3, settings=project, margin=0.6)

    assert third.holdout_digest != first.holdout_digest
    assert not third.champion_score_reused and not third.challenger_score_reused
    assert (_work_folder(project, 3) / "v1.csv").is_file()
    assert third.champion_score == pytest.approx(0.25)


def test_a_holdouts_identity_is_its_content_not_its_place(holdout: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(holdout, tmp_path / "elsewhere" / "holdout")
    digest = content_digest(holdout)

    assert digest is not None and content_digest(copy) == digest  # another folder, same images
    # Streamed, it hashes the very bytes the whole-record digest did (scores recorded before
    # stay keyed by it): json.dumps of the record, keys sorted.
    manifest = read_manifest(copy)
    record = {
        "format_version": manifest.format_version,
        "labeled": manifest.labeled,
        "classes": manifest.classes,
        "transform": None,
        "images": [[e.path, e.label, e.sha256] for e in manifest.images],
    }
    assert digest == hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()
    manifest.images[0].label = 1 - int(manifest.images[0].label or 0)  # one image relabeled
    write_manifest(copy, manifest)
    assert content_digest(copy) not in (None, digest)
    image = copy / read_manifest(copy).images[0].path
    image.write_bytes(image.read_bytes() + b"edited")  # an image edited in place
    assert content_digest(copy) is None  # the manifest no longer says what the folder holds


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"metric": "loss"}, "metric must be one of"),
        ({"margin": -0.1}, r"margin must be in \[0, 1\)"),
        ({"candidate": "latest"}, "not a valid MLflow alias"),
    ],
)
def test_bad_parameters_are_refused_before_scoring(
    project: Settings, holdout: Path, kwargs: dict, match: str
) -> None:
    with pytest.raises(InvalidParameterError, match=match):
        promote(holdout, settings=project, **kwargs)


def test_a_missing_candidate_or_a_non_image_directory_is_a_clear_error(
    project: Settings, holdout: Path, tmp_path: Path
) -> None:
    with pytest.raises(RegistryError, match="has no version 'challenger'"):
        promote(holdout, settings=project)
    with pytest.raises(InvalidParameterError, match="is not an ImageDirectory"):
        promote(tmp_path, settings=project)
