"""The zoo beyond Azure's two components: every torchvision classifier by name, and timm's models.

Weights are written locally in the published layouts (torch.hub's checkpoints folder, the Hugging
Face hub cache), with the network cut off: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from unittest import mock

import pytest
import safetensors.torch
import torch
import torchvision

from models.errors import InvalidModelDirectoryError
from models.pretrained import hub_cache, pretrained_weights_path, weights_cached
from models.untrained import DENSENETS, RESNETS, TORCHVISION, ModelChoice, spec_for
from models.zoo import (
    InputSizeError,
    PretrainedWeightsMissingError,
    build_model,
    head_parameters,
    network_for,
    preprocessing,
)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No network (every download goes to a proxy port that refuses), and an empty cache."""
    for var in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    return tmp_path / "torch"


def test_the_zoo_is_every_torchvision_classifier() -> None:
    """A torchvision upgrade that adds a network fails here, until the zoo lists it."""
    listed = set(torchvision.models.list_models(module=torchvision.models))
    assert set(DENSENETS + RESNETS + TORCHVISION) == listed
    assert len(DENSENETS + RESNETS + TORCHVISION) == len(listed)  # no name twice


# RegNet's builder computes its widths with tensors, which the meta device cannot hold: those
# are built for real, all but the 644M-parameter regnet_y_128gf (RegNet's class, as the others).
BUILT_FOR_REAL = tuple(a for a in TORCHVISION if a.startswith("regnet_"))


@pytest.mark.parametrize("arch", [a for a in TORCHVISION if a != "regnet_y_128gf"])
def test_every_torchvision_network_gets_our_head(arch: str) -> None:
    """Built on the meta device (shapes only, no memory): the head found is the one with our
    classes, for from-scratch and pretrained layouts alike."""
    size = max(64, torchvision.models.get_model_weights(arch).DEFAULT.meta["min_size"][0])
    for pretrained in (False, True):
        spec = spec_for(arch, pretrained=pretrained)
        with torch.device("cpu" if arch in BUILT_FOR_REAL else "meta"):
            model = build_model(spec, 7, size, load_weights=False)
        head = network_for(spec).head(model)
        assert (getattr(head, "out_features", None) or head.out_channels) == 7, (arch, pretrained)
        assert head_parameters(spec, model)
        assert not getattr(model, "aux_logits", False)  # Inception's extra heads are gone


@pytest.mark.parametrize(
    ("arch", "size"), [("mobilenet_v3_small", 32), ("squeezenet1_1", 32), ("vit_b_32", 32)]
)
def test_small_networks_train_from_scratch_at_the_transforms_size(arch: str, size: int) -> None:
    model = build_model(spec_for(arch), 3, size)
    assert model(torch.zeros(2, 3, size, size)).shape == (2, 3)


def test_an_input_the_network_cannot_take_is_refused_before_training() -> None:
    with pytest.raises(InputSizeError, match=r"inception_v3 needs an input of at least 75x75"):
        build_model(spec_for("inception_v3"), 3, 32)
    with pytest.raises(InputSizeError, match="not a multiple of 16"):
        build_model(spec_for("vit_b_16"), 3, 40)
    with torch.device("meta"), pytest.raises(InputSizeError, match="take 224x224 pixels only"):
        build_model(spec_for("vit_b_16", pretrained=True), 3, 64, load_weights=False)


def _write_published(arch: str) -> dict[str, torch.Tensor]:
    """A stand-in for torchvision's published file: same path, names and shapes; every tensor a
    value of its own (1-element storages, so the file is small)."""
    with torch.device("meta"):
        network = torchvision.models.get_model(arch)  # torchvision's layout: aux heads and all
    state = {}
    for i, (key, value) in enumerate(network.state_dict().items()):
        if value.dim() == 0:  # BatchNorm's num_batches_tracked
            state[key] = torch.tensor(i)
        else:
            state[key] = torch.full((1,), float(i)).expand(value.shape)
    path = pretrained_weights_path(arch)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return state


@pytest.mark.parametrize("arch", ["googlenet", "squeezenet1_1", "efficientnet_b0"])
def test_pretrained_torchvision_weights_load_under_a_new_head(arch: str, offline: Path) -> None:
    published = _write_published(arch)
    spec = spec_for(arch, pretrained=True)
    assert weights_cached(spec)
    model = build_model(spec, 3, 224)
    loaded = model.state_dict()
    head = network_for(spec).head_name(model) + "."
    kept = [k for k in published if not k.startswith((head, "aux1.", "aux2."))]
    assert set(loaded) == {*kept, head + "weight", head + "bias"}  # aux heads dropped
    for key in kept:
        assert torch.equal(loaded[key], published[key]), key
    assert network_for(spec).head(model).weight.shape[0] == 3
    if arch == "googlenet":  # its weights were trained on another normalisation
        assert model.transform_input is True
    with torch.no_grad():
        assert model.eval()(torch.zeros(1, 3, 224, 224)).shape == (1, 3)


def test_the_weights_metadata_sets_the_transform() -> None:
    b3 = preprocessing(spec_for("efficientnet_b3", pretrained=True))
    assert (b3.resize_size, b3.crop_size, b3.interpolation) == (320, 300, "bicubic")
    v2l = preprocessing(spec_for("efficientnet_v2_l", pretrained=True))
    assert (v2l.mean, v2l.std) == ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    r18 = preprocessing(spec_for("resnet18", pretrained=True))
    assert (r18.resize_size, r18.crop_size) == (256, 224)


# --- timm ------------------------------------------------------------------------------------

TIMM_NAME = "timm/resnet18.a1_in1k"


def test_timm_models_are_a_family_of_the_zoo() -> None:
    spec = ModelChoice(name=TIMM_NAME, pretrained=False).spec()
    assert spec.family == "timm"
    model = build_model(spec, 3, 32)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 3)
    assert head_parameters(spec, model) == {id(p) for p in model.fc.parameters()}


def test_an_unknown_timm_name_is_refused_naming_similar_ones(tmp_path: Path) -> None:
    from tasks.train.build_model import build_model as write_model_directory

    with pytest.raises(InvalidModelDirectoryError, match="timm has no model 'resnet18x'") as err:
        build_model(spec_for("timm/resnet18x"), 3, 32)
    assert "resnet18" in err.value.hint
    with pytest.raises(InvalidModelDirectoryError, match="timm has no model"):  # at once
        write_model_directory({"name": "timm/resnet18x", "pretrained": False}, tmp_path / "m")
    assert not (tmp_path / "m").exists()


def _write_hub_cache(repo: str) -> dict[str, torch.Tensor]:
    """timm's weights in the Hugging Face hub cache layout, as `hf download` leaves them."""
    import timm

    torch.manual_seed(0)
    state = timm.create_model(repo.removeprefix("timm/"), pretrained=False).state_dict()
    folder = hub_cache() / f"models--{repo.replace('/', '--')}"
    commit = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    (folder / "snapshots" / commit).mkdir(parents=True)
    safetensors.torch.save_file(state, folder / "snapshots" / commit / "model.safetensors")
    return state


def test_timm_weights_load_from_the_hub_cache(offline: Path) -> None:
    spec = spec_for(TIMM_NAME, pretrained=True)
    assert not weights_cached(spec)
    started = time.monotonic()
    with pytest.raises(PretrainedWeightsMissingError, match="not in the cache") as err:
        build_model(spec, 3, 224)
    assert str(hub_cache()) in err.value.hint
    # At once: the hub's client retried the refused connection for 23 s before the same error.
    assert time.monotonic() - started < 10

    published = _write_hub_cache(TIMM_NAME)
    assert weights_cached(spec)
    model = build_model(spec, 3, 224)
    assert model.fc.out_features == 3
    assert torch.equal(model.conv1.weight, published["conv1.weight"])
    assert torch.equal(model.layer4[1].bn2.running_var, published["layer4.1.bn2.running_var"])


def test_timm_pretrained_cfg_sets_the_transform() -> None:
    seen = preprocessing(spec_for(TIMM_NAME, pretrained=True))
    # resnet18.a1_in1k: rated at 224 of a 0.95 crop share, bicubic, ImageNet's mean and std.
    assert (seen.crop_size, seen.resize_size, seen.interpolation) == (224, 235, "bicubic")
    assert seen.mean == pytest.approx((0.485, 0.456, 0.406))


def test_transform_init_like_a_model_writes_the_weights_input(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from app.cli import app

    dest = tmp_path / "t"
    with mock.patch.dict(os.environ):  # the CLI exports its settings: keep them in here
        result = CliRunner().invoke(
            app, ["transform", "init", str(dest), "--like-model", "efficientnet_v2_l"]
        )
    assert result.exit_code == 0, result.output
    spec = json.loads((dest / "transform.json").read_text())["transform"]
    assert (spec["resize_size"], spec["center_crop_size"]) == (480, 480)
    assert spec["mean"] == [0.5, 0.5, 0.5]
    assert "480x480" in result.output


def test_model_list_names_every_family_and_timms_models_on_demand() -> None:
    from typer.testing import CliRunner

    from app.cli import app

    with mock.patch.dict(os.environ):  # the CLI exports its settings: keep them in here
        result = CliRunner().invoke(app, ["model", "list", "--timm", "resnet18*", "--pretrained"])
    assert result.exit_code == 0, result.output
    for name in ("densenet201", "resnext101_32x8d", "efficientnet_v2_s", "maxvit_t", "vit_h_14"):
        assert name in result.output
    assert "timm/resnet18.a1_in1k" in result.output
