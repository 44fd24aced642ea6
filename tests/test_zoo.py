"""The model zoo: Azure's DenseNet and ResNet components, and building networks from them."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torchvision

from models.errors import InvalidModelDirectoryError
from models.pretrained import pretrained_weights_path
from models.untrained import (
    DENSENETS,
    FAMILIES,
    MODEL_JSON,
    RESNETS,
    Family,
    ModelChoice,
    architectures,
    densenet,
    read_untrained,
    resnet,
    spec_for,
    write_untrained,
)
from models.zoo import NETWORKS, Network, PretrainedWeightsMissingError, build_model


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
    [lambda: densenet("densenet9"), lambda: resnet("resnet9"), lambda: spec_for("vgg17")],
    ids=["densenet", "resnet", "any"],
)
def test_unknown_names_are_refused(make) -> None:
    with pytest.raises(InvalidModelDirectoryError, match=r"Unknown .* model name") as err:
        make()
    assert "Did you mean" in err.value.hint  # densenet9 -> densenet169, vgg17 -> vgg16 ...


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


# --- torchvision's published weights files ------------------------------------------------------


def _published_key(key: str) -> str:
    """The name torchvision's published file gives a parameter of today's network.

    The DenseNet files (ported from LuaTorch) keep the old dense-layer names: 'norm.1', 'conv.1',
    'norm.2', 'conv.2' where the network now has 'norm1', 'conv1', ...; ResNet files use today's.
    """
    return re.sub(r"(\.denselayer\d+\.(?:norm|conv))([12])\.", r"\1.\2.", key)


def _write_published_file(
    arch: str, torch_home: Path, source: str | None = None
) -> dict[str, torch.Tensor]:
    """Write a stand-in for torchvision's published weights file for ``arch``; return its tensors.

    Same file name and folder as the real one, same key names and shapes (of ``source``'s network,
    ``arch`` by default). Every tensor holds one value of its own, so a parameter loaded under the
    wrong name is seen; each is a 1-element storage expanded to its shape, so the file is a few
    hundred KB even for wide_resnet101_2. The DenseNet files (2017) predate BatchNorm's batch
    counter, so theirs have none.
    """
    url = torchvision.models.get_model_weights(arch).DEFAULT.url
    path = torch_home / "hub" / "checkpoints" / os.path.basename(url)
    with torch.device("meta"):  # names and shapes only: no memory, no init
        network = torchvision.models.get_model(source or arch)
    state = {}
    for i, (key, value) in enumerate(network.state_dict().items()):
        if key.endswith("num_batches_tracked"):
            if arch not in DENSENETS:
                state[key] = torch.tensor(i)
        else:
            state[_published_key(key)] = torch.full((1,), float(i)).expand(value.shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return state


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch on one thread: these tests copy hundreds of MB, and on a busy 2-core machine two
    threads spinning on each copy take twice as long as one (18 s against 11 s for the 13 nets)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("arch", DENSENETS + RESNETS)
def test_pretrained_weights_load_from_torchvisions_published_file(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: None, one_thread: None
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    published = _write_published_file(arch, tmp_path / "torch")
    assert pretrained_weights_path(arch).stat().st_size < 1_000_000  # no GBs on disk
    if arch in DENSENETS:  # the old names, as in the file torchvision publishes
        assert "features.denseblock1.denselayer1.norm.1.weight" in published
        assert "features.denseblock1.denselayer1.conv.2.weight" in published

    model = build_model(spec_for(arch, pretrained=True), num_classes=3)

    head = model.classifier if arch in DENSENETS else model.fc
    assert head.out_features == 3
    is_head = ("classifier.", "fc.")
    loaded = model.state_dict()
    from_file = set()
    for key, value in loaded.items():
        if key.startswith(is_head):
            continue
        if key.endswith("num_batches_tracked") and arch in DENSENETS:
            assert value == 0, key  # not in the file: BatchNorm starts the count at 0
            continue
        assert torch.equal(value, published[_published_key(key)]), key
        assert value.is_contiguous(), key  # copied into the network, not the file's 1-element view
        from_file.add(_published_key(key))
    assert from_file == {key for key in published if not key.startswith(is_head)}


class _RunsCode:
    """Unpickling this creates a marker file: a weights file that would run code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _write_resnet18_weights(path: Path, tmp_path: Path) -> None:
    _write_published_file("resnet34", tmp_path / "torch", source="resnet18")


def _write_resnext_weights(path: Path, tmp_path: Path) -> None:
    _write_published_file("resnet50", tmp_path / "torch", source="resnext50_32x4d")


def _write_truncated(path: Path, tmp_path: Path) -> None:
    _write_published_file("resnet18", tmp_path / "torch")
    path.write_bytes(path.read_bytes()[:5000])  # an interrupted copy


def _write_code(path: Path, tmp_path: Path) -> None:
    path.parent.mkdir(parents=True)
    torch.save({"conv1.weight": _RunsCode(tmp_path / "ran")}, path)


def _write_other_names(path: Path, tmp_path: Path) -> None:
    path.parent.mkdir(parents=True)
    torch.save({"features.conv0.weight": torch.zeros(64, 3, 7, 7), "extra": torch.zeros(1)}, path)


def _write_list(path: Path, tmp_path: Path) -> None:
    path.parent.mkdir(parents=True)
    torch.save([torch.zeros(1)], path)


@pytest.mark.parametrize(
    ("arch", "write", "problem"),
    [
        ("resnet34", _write_resnet18_weights,
         r"parameter names differ: \d+ missing, e\.g\. 'layer1\.2\."),
        ("resnet50", _write_resnext_weights,
         r"a tensor has another shape \(size mismatch for layer1\.0\.conv1\.weight: "),
        ("densenet121", _write_other_names,
         r"\d+ missing, e\.g\. 'features\.norm0\.weight'; 1 unexpected, e\.g\. 'extra'"),
        ("resnet18", _write_truncated, "cannot be read as PyTorch weights"),
        ("resnet18", _write_code, "cannot be read as PyTorch weights"),
        ("resnet18", _write_list, "no mapping of parameter names to tensors"),
    ],
    ids=["another-network", "another-shape", "other-names", "truncated", "runs-code", "a-list"],
)  # fmt: skip
def test_an_unexpected_weights_file_is_refused_naming_it(
    arch: str,
    write,
    problem: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    offline: None,
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    path = pretrained_weights_path(arch)
    write(path, tmp_path)
    with pytest.raises(InvalidModelDirectoryError, match=problem) as err:
        build_model(spec_for(arch, pretrained=True), num_classes=3)
    assert str(path) in err.value.message
    assert f"Delete {path}" in err.value.hint
    assert f"`imageops model build DEST --name {arch} --no-pretrained`" in err.value.hint
    assert not (tmp_path / "ran").exists()  # the file was read as data, never run


# --- extension point: a model family is one Family and one Network ----------------------------


@pytest.fixture
def shufflenets(monkeypatch: pytest.MonkeyPatch) -> Family:
    """A toy family, registered for one test: torchvision's smallest ShuffleNet, taken out of the
    torchvision family for it."""
    family = Family("shufflenet", "ShuffleNet", ("shufflenet_v2_x0_5",))
    others = tuple(a for a in FAMILIES["torchvision"].archs if a not in family.archs)
    monkeypatch.setitem(FAMILIES, "torchvision", Family("torchvision", "torchvision", others))
    monkeypatch.setitem(FAMILIES, family.name, family)
    monkeypatch.setitem(NETWORKS, family.name, Network())  # its head is `fc`, as ResNet's
    return family


def test_a_new_family_is_one_registry_line_and_every_entry_point_offers_it(
    shufflenets: Family, tmp_path: Path
) -> None:
    spec = ModelChoice(name="shufflenet_v2_x0_5", pretrained=False).spec()
    assert spec.family == "shufflenet"
    model = build_model(read_untrained(write_untrained(spec, tmp_path / "m")), num_classes=3)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 3)
    assert "shufflenet_v2_x0_5" in architectures()
    with pytest.raises(InvalidModelDirectoryError, match="applies to DenseNets"):
        spec_for("shufflenet_v2_x0_5", memory_efficient=True)  # another family's switch


def test_an_unknown_family_is_refused_never_built_as_a_resnet(
    shufflenets: Family, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = write_untrained(spec_for("shufflenet_v2_x0_5"), tmp_path / "m")
    monkeypatch.delitem(NETWORKS, "shufflenet")  # a family without its network builder
    with pytest.raises(InvalidModelDirectoryError, match=r"No network builder .*'shufflenet'"):
        build_model(read_untrained(dest), num_classes=3)
    monkeypatch.delitem(FAMILIES, "shufflenet")  # a model.json of a family imageops lacks
    with pytest.raises(InvalidModelDirectoryError, match="family 'shufflenet'"):
        read_untrained(dest)
