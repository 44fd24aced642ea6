"""The model zoo: the seed's DenseNet and ResNet components, and building networks from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torchvision

from models.errors import InvalidModelDirectoryError
from models.zoo import (
    DENSENETS,
    MODEL_JSON,
    RESNETS,
    PretrainedWeightsMissingError,
    build_model,
    densenet,
    pretrained_weights_path,
    read_untrained,
    resnet,
    spec_for,
    write_untrained,
)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No network, deterministically: every download goes to a proxy port that refuses."""
    for var in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("name", DENSENETS + RESNETS)
def test_every_zoo_name_writes_an_untrained_model_directory(name: str, tmp_path: Path) -> None:
    dest = write_untrained(spec_for(name, pretrained=True), tmp_path / name)
    assert sorted(p.name for p in dest.iterdir()) == [MODEL_JSON]  # no weights, nothing pickled
    spec = read_untrained(dest)
    assert spec.arch == name
    assert spec.family == ("densenet" if name in DENSENETS else "resnet")
    assert spec.pretrained is True


def test_seed_defaults() -> None:
    assert densenet() == spec_for("densenet201", pretrained=True)
    assert resnet() == spec_for("resnext101_32x8d", pretrained=True)
    assert densenet().memory_efficient is False
    assert resnet().zero_init_residual is False


@pytest.mark.parametrize("name", ["densenet121", "resnet18"])
def test_build_has_one_output_per_class(name: str) -> None:
    model = build_model(spec_for(name, pretrained=False), num_classes=3).eval()
    with torch.no_grad():
        assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 3)


@pytest.mark.parametrize(
    "make",
    [lambda: densenet("densenet9"), lambda: resnet("resnet9"), lambda: spec_for("vgg16")],
    ids=["densenet", "resnet", "any"],
)
def test_unknown_names_are_refused(make) -> None:
    with pytest.raises(InvalidModelDirectoryError, match="Choose one of"):
        make()


def _model_json(tmp_path: Path, content: str) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / MODEL_JSON).write_text(content)
    return folder


UNTRAINED = {"format": "imageops.UntrainedModelDirectory", "family": "resnet", "pretrained": False}


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps({**UNTRAINED, "arch": "resnet9000"}),
        json.dumps({**UNTRAINED, "arch": "densenet121"}),  # a DenseNet name in the ResNet family
        json.dumps({**UNTRAINED, "arch": "resnet18", "weights": "evil.pkl"}),
        json.dumps({"format": "imageops.ModelDirectory", "classes": ["a"]}),  # a trained one
    ],
    ids=["garbage", "unknown-arch", "wrong-family", "unknown-key", "trained"],
)
def test_bad_model_directories_are_refused(content: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidModelDirectoryError):
        read_untrained(_model_json(tmp_path, content))


def test_a_folder_without_model_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidModelDirectoryError, match=r"no model\.json"):
        read_untrained(tmp_path)
    with pytest.raises(InvalidModelDirectoryError, match=r"no model\.json"):
        read_untrained(tmp_path / "missing")


def test_pretrained_weights_load_from_the_cache_and_get_a_new_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    path = pretrained_weights_path("resnet18")
    assert path.is_relative_to(tmp_path / "torch")
    path.parent.mkdir(parents=True)
    torch.manual_seed(0)
    imagenet = torchvision.models.resnet18(weights=None)  # stands in for the released file
    torch.save(imagenet.state_dict(), path)

    model = build_model(resnet("resnet18", pretrained=True), num_classes=3).eval()
    assert model.fc.out_features == 3
    assert torch.equal(model.conv1.weight, imagenet.conv1.weight)
    assert torch.equal(model.layer4[1].bn2.running_mean, imagenet.layer4[1].bn2.running_mean)
    with torch.no_grad():
        assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 3)


def test_missing_pretrained_weights_name_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    with pytest.raises(PretrainedWeightsMissingError) as err:
        build_model(resnet("resnet18", pretrained=True), num_classes=3)
    assert str(pretrained_weights_path("resnet18")) in str(err.value)
    assert not pretrained_weights_path("resnet18").exists()  # no half-downloaded file left
