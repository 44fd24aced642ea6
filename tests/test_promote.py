"""Promotion on a real MLflow registry (SQLite): champion only for a challenger that wins.

The two models are resnet18s whose head always answers one class ("0" or "1"), so their scores on
a held-out set are known exactly: on a holdout of three 0s and one 1, the "always 0" model scores
accuracy 0.75 and the "always 1" model 0.25. Scoring goes through each version's ONNX model as
downloaded from the registry, as in production.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from model_helpers import make_model_dir

from models.directory import load_model_directory, save_model_directory
from tasks.data.convert import convert
from tasks.inference.export import export_onnx
from tasks.registry.promote import CHALLENGER, CHAMPION, promote
from tasks.registry.register import register
from tasks.shared.errors import InvalidParameterError, RegistryError
from tasks.shared.settings import Settings

pytest_plugins = ["model_fixtures"]

NAME = "imageops-classifier"


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


@pytest.fixture(scope="module")
def holdout(tmp_path_factory: pytest.TempPathFactory, digits_raw: Path) -> Path:
    """A labeled ImageDirectory of three 0s and one 1."""
    root = tmp_path_factory.mktemp("holdout")
    for digit, count in (("0", 3), ("1", 1)):
        (root / "raw" / digit).mkdir(parents=True)
        for path in sorted((digits_raw / digit).glob("*.png"))[:count]:
            shutil.copyfile(path, root / "raw" / digit / path.name)
    convert(root / "raw", root / "images")
    return root / "images"


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
    assert tags["promotion.decision"] == "promoted"
    assert "no champion" in tags["promotion.reason"]
    assert float(tags["promotion.challenger_score"]) == pytest.approx(0.25)


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
    assert tags["promotion.decision"] == "promoted"
    assert float(tags["promotion.challenger_score"]) == pytest.approx(0.75)
    assert float(tags["promotion.champion_score"]) == pytest.approx(0.25)
    assert tags["promotion.holdout"] == str(holdout.resolve())
    assert client.get_model_version(NAME, "1").tags["promotion.replaced_by"] == "2"

    # Version 1 again, now as the candidate against champion v2: it loses, nothing moves.
    again = promote(holdout, candidate=1, settings=project)

    assert not again.promoted
    assert "not more than the margin" in again.reason
    assert _alias(CHAMPION) == 2
    assert client.get_model_version(NAME, "1").tags["promotion.decision"] == "not promoted"
    # the champion's own record stands; the defence is written beside it
    champion = client.get_model_version(NAME, "2").tags
    assert champion["promotion.decision"] == "promoted"
    assert float(champion["promotion.challenger_score"]) == pytest.approx(0.75)
    assert champion["promotion.defended_against"] == "1"
    assert "not more than the margin" in champion["promotion.defended_reason"]


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


def test_the_champion_against_itself_stays(
    project: Settings, always: dict[str, Path], holdout: Path
) -> None:
    register(always["0"], settings=project, alias=CHAMPION)
    MlflowClient().set_registered_model_alias(NAME, CHALLENGER, "1")

    decision = promote(holdout, settings=project)

    assert not decision.promoted
    assert "already the champion" in decision.reason


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
