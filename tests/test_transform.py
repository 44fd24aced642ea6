"""Init / Apply Image Transformation: Azure's options, both modes on real digits, the spec a
ModelDirectory stores and scoring rebuilds."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pandas as pd
import pytest
import torch
from model_helpers import make_model_dir
from PIL import Image
from torchvision.transforms import v2

from models.directory import ONNX, read_model_info
from models.transform_spec import RECIPE_FIELDS, TransformSpec
from models.untrained import resnet, write_untrained
from tasks.data.imagedir import load_rgb, read_manifest
from tasks.data.transform import (
    TRANSFORM_JSON,
    apply_transformation,
    build_transform,
    inference_resize,
    init_transformation,
    input_size,
    read_transformation,
    transform_spec,
)
from tasks.inference.export import export_onnx
from tasks.inference.score import score
from tasks.shared.errors import (
    InvalidParameterError,
    InvalidTransformationDirectoryError,
)
from tasks.shared.settings import Settings
from tasks.train.data import ManifestImageFolder
from tasks.train.launch import train
from tasks.train.request import TrainRequest

pytest_plugins = ["model_fixtures"]

ROOT = Path(__file__).resolve().parents[1]

# The Azure design's Init Image Transformation, option by option.
SEED_DEFAULTS = {
    "resize": True,
    "resize_size": 256,
    "center_crop": True,
    "center_crop_size": 224,
    "pad": False,
    "padding": 0,
    "color_jitter": False,
    "grayscale": False,
    "random_resized_crop": False,
    "random_resized_crop_size": 256,
    "random_crop": False,
    "random_crop_size": 224,
    "random_horizontal_flip": True,
    "random_vertical_flip": False,
    "random_rotation": False,
    "random_rotation_degrees": 0,
    "random_affine": False,
    "random_affine_degrees": 0,
    "random_grayscale": False,
    "random_perspective": False,
    "random_erasing": False,
}
SWITCHES = [name for name, value in SEED_DEFAULTS.items() if isinstance(value, bool)]
RANDOM = [n for n in SWITCHES if n.startswith("random_")] + ["color_jitter"]
RANDOM_CLASSES = (
    v2.RandomResizedCrop,
    v2.RandomCrop,
    v2.RandomHorizontalFlip,
    v2.RandomVerticalFlip,
    v2.RandomRotation,
    v2.RandomAffine,
    v2.RandomGrayscale,
    v2.RandomPerspective,
    v2.RandomErasing,
    v2.ColorJitter,
)
# Sized for the 16x16 test digits, every size consistent: the network sees 16 + 2 x 2 = 20.
SMALL = {
    "resize_size": 18,
    "center_crop_size": 16,
    "random_resized_crop_size": 16,
    "random_crop_size": 16,
    "padding": 2,
    "random_rotation_degrees": 30,
    "random_affine_degrees": 30,
    "random_horizontal_flip": False,
}


def _image(digits: Path, index: int = 0) -> Image.Image:
    manifest = read_manifest(digits)
    return load_rgb(digits / manifest.images[index].path)


def _outputs(transform: v2.Compose, image: Image.Image, seeds: range) -> list[torch.Tensor]:
    outputs = []
    for seed in seeds:
        torch.manual_seed(seed)
        outputs.append(transform(image))
    return outputs


# --- the spec ---------------------------------------------------------------------------------


def test_defaults_are_the_seeds_and_every_option_is_explained() -> None:
    from tasks.train.recipes import resolve_transform

    # What a `--recipe azure` run uses: the empty recipe fields filled by the Azure component's.
    spec = resolve_transform(TransformSpec(), "azure").model_dump()
    assert {k: spec[k] for k in SEED_DEFAULTS} == SEED_DEFAULTS
    assert len(SEED_DEFAULTS) == 21  # the Azure design's options, plus the normalisation below
    assert spec["mean"] == [0.485, 0.456, 0.406] and spec["std"] == [0.229, 0.224, 0.225]
    assert (spec["augmentation"], spec["random_erasing_probability"]) == ("none", 0.5)
    schema = TransformSpec.model_json_schema()["properties"]  # what the Prefect form shows
    assert set(schema) == {
        *SEED_DEFAULTS,
        *RECIPE_FIELDS,
        "random_resized_crop_scale",
        "mean",
        "std",
    }
    assert spec["random_resized_crop_scale"] == 0.08  # Azure's "8% to 100%"
    assert all(field.get("title") and field.get("description") for field in schema.values())
    for name in ("random_rotation_degrees", "random_affine_degrees"):
        assert (schema[name]["minimum"], schema[name]["maximum"]) == (0, 180)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"random_rotation_degrees": 200}, "random_rotation_degrees = 200, expected an integer "
         "from 0 to 180 (default 0)"),
        ({"random_affine_degrees": -1}, "random_affine_degrees = -1, expected an integer from 0"),
        ({"center_crop_size": 0}, "center_crop_size = 0, expected an integer > 0 (default 224)"),
        ({"resize_size": 0}, "resize_size = 0, expected an integer > 0"),
        ({"random_crop_size": -3}, "random_crop_size = -3, expected an integer > 0"),
        ({"padding": -1}, "padding = -1, expected an integer >= 0"),
        ({"std": [0.2, 0.0, 0.2]}, "std[1] = 0.0: input should be greater than 0"),
        ({"mean": [0.5, 0.5]}, "mean = "),
        ({"rotation": True}, "unknown parameter 'rotation'"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_naming_option_value_and_range(
    values: dict, message: str, tmp_path: Path
) -> None:
    with pytest.raises(InvalidParameterError) as err:
        transform_spec(**values)
    assert message in str(err.value)
    with pytest.raises(InvalidParameterError, match=re.escape(message)):
        init_transformation(tmp_path / "t", values)
    assert not (tmp_path / "t").exists()  # refused before anything is written


def test_init_writes_a_directory_that_reads_back(tmp_path: Path) -> None:
    spec = transform_spec(**SMALL, grayscale=True, mean=[0.5, 0.5, 0.5])
    dest = init_transformation(tmp_path / "transform", spec)
    data = json.loads((dest / TRANSFORM_JSON).read_text())
    assert data["format"] == "imageops.TransformationDirectory"
    assert read_transformation(dest) == spec
    assert read_transformation(init_transformation(tmp_path / "seed")) == TransformSpec()


def _write(path: Path, text: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / TRANSFORM_JSON).write_text(text)
    return path


def test_an_invalid_transformation_directory_is_refused(
    tmp_path: Path, digits_split: tuple[Path, Path]
) -> None:
    good = json.loads((init_transformation(tmp_path / "good") / TRANSFORM_JSON).read_text())
    cases = {
        tmp_path / "missing": "transform.json is missing",
        tmp_path / "good" / TRANSFORM_JSON: "transform.json is missing",  # a file, not a folder
        _write(tmp_path / "not-json", "{"): "not readable JSON",
        _write(tmp_path / "other", json.dumps({"format": "x"})): "not a transform spec",
        _write(tmp_path / "newer", json.dumps({**good, "format_version": 99})): "format version 99",
        _write(
            tmp_path / "range",
            json.dumps({**good, "transform": {**good["transform"], "random_affine_degrees": 181}}),
        ): "random_affine_degrees = 181, expected an integer from 0 to 180",
        _write(
            tmp_path / "unknown", json.dumps({**good, "transform": {"flip": True}})
        ): "unknown parameter 'flip'",
    }
    for path, message in cases.items():
        with pytest.raises(InvalidTransformationDirectoryError, match=message) as err:
            read_transformation(path)
        assert "imageops transform init" in err.value.hint
    with pytest.raises(InvalidTransformationDirectoryError):
        apply_transformation(tmp_path / "missing", digits_split[1], tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- building and running the transforms on real digits ---------------------------------------


@pytest.mark.parametrize("option", SWITCHES)
def test_every_option_builds_and_runs_on_a_real_image(
    option: str, digits_split: tuple[Path, Path]
) -> None:
    spec = transform_spec(**{**SMALL, option: True})
    side = input_size(spec)
    image = _image(digits_split[0])
    for mode in ("training", "inference"):
        torch.manual_seed(0)
        tensor = build_transform(spec, mode)(image)
        assert tensor.dtype == torch.float32 and tensor.shape == (3, side, side), (mode, option)
        assert torch.isfinite(tensor).all()
        picture = build_transform(spec, mode, normalize=False)(image)  # for Apply
        assert picture.dtype == torch.uint8 and picture.shape[0] == 3


def test_all_options_on_together(digits_split: tuple[Path, Path]) -> None:
    spec = transform_spec(**{**SMALL, **dict.fromkeys(SWITCHES, True)})
    assert input_size(spec) == 20
    image = _image(digits_split[0])
    for tensor in _outputs(build_transform(spec, "training"), image, range(5)):
        assert tensor.shape == (3, 20, 20)
    assert build_transform(spec, "inference")(image).shape == (3, 20, 20)


def test_inference_drops_every_random_transform_and_is_deterministic(
    digits_split: tuple[Path, Path],
) -> None:
    everything = transform_spec(**{**SMALL, **dict.fromkeys(SWITCHES, True)})
    inference = build_transform(everything, "inference")
    assert not [t for t in inference.transforms if isinstance(t, RANDOM_CLASSES)]
    image = _image(digits_split[0])
    outputs = _outputs(inference, image, range(4))
    assert all(torch.equal(outputs[0], out) for out in outputs)
    # the same as the spec with every random option off
    calm = everything.model_copy(update=dict.fromkeys(RANDOM, False))
    assert torch.equal(outputs[0], build_transform(calm, "inference")(image))


def test_training_flips_differ_across_seeds_and_repeat_with_the_same_seed(
    digits_split: tuple[Path, Path],
) -> None:
    spec = transform_spec(**{**SMALL, "random_horizontal_flip": True, "random_vertical_flip": True})
    training = build_transform(spec, "training")
    assert {type(t) for t in training.transforms} >= {
        v2.RandomHorizontalFlip,
        v2.RandomVerticalFlip,
    }
    image = _image(digits_split[0], index=-1)  # a "2": no flip leaves it as it was
    outputs = _outputs(training, image, range(8))
    distinct = {hashlib.sha256(out.numpy().tobytes()).hexdigest() for out in outputs}
    assert len(distinct) > 1
    assert torch.equal(_outputs(training, image, range(3, 4))[0], outputs[3])


def test_training_crops_and_decides_the_input_size() -> None:
    assert input_size(TransformSpec()) == 224
    assert input_size(transform_spec(pad=True, padding=4)) == 232
    assert input_size(transform_spec(random_crop=True)) == 224
    # random resized crop (256) then random crop (224): the last crop, 224
    assert input_size(transform_spec(random_resized_crop=True, random_crop=True)) == 224
    assert input_size(transform_spec(random_resized_crop=True)) == 256
    assert input_size(transform_spec(random_crop=True, random_crop_size=28)) == 28
    assert input_size(transform_spec(center_crop=False)) == 256  # the resize's centered square
    with pytest.raises(InvalidTransformationDirectoryError, match="all off"):
        input_size(transform_spec(resize=False, center_crop=False))


@pytest.mark.parametrize("option", [None, *SWITCHES, "all"])
def test_the_azure_defaults_are_valid_with_any_switch_on(
    option: str | None, digits_split: tuple[Path, Path]
) -> None:
    """Each switch of Init Image Transformation on, every size at its Azure default: both modes
    give the same, training-decided input size on a non-square image."""
    switches = (
        dict.fromkeys(SWITCHES, True) if option == "all" else {option: True} if option else {}
    )
    spec = transform_spec(**{**SEED_DEFAULTS, **switches})
    side = input_size(spec)
    assert side == (256 if option == "random_resized_crop" else 224)
    image = _image(digits_split[0]).resize((40, 30))
    for mode in ("training", "inference"):
        torch.manual_seed(0)
        assert build_transform(spec, mode)(image).shape == (3, side, side), mode


def test_inference_keeps_the_center_crops_share_at_the_training_size() -> None:
    spec = transform_spec(random_resized_crop=True)  # crops 256 in training; 224 of 256 before
    assert inference_resize(spec) == round(256 * 256 / 224) == 293
    steps = build_transform(spec, "inference").transforms
    assert [type(t) for t in steps[1:3]] == [v2.Resize, v2.CenterCrop]
    assert (steps[1].size, steps[2].size) == ([293], (256, 256))
    # sizes that agree keep the spec's own resize
    assert inference_resize(TransformSpec()) == 256


def test_training_with_a_crop_of_another_size_scores_at_that_size(
    project: Settings, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    """Random crop 12 with center crop 16: accepted; the model, its ONNX export and scoring all
    take 12x12 inputs."""
    untrained = write_untrained(resnet("resnet18", pretrained=False), tmp_path / "untrained")
    spec = init_transformation(
        tmp_path / "t", {**SMALL, "pad": False, "random_crop": True, "random_crop_size": 12}
    )
    request = TrainRequest(
        model=untrained, train_data=digits_split[0], val_data=digits_split[1],
        out=tmp_path / "model", params={"epochs": 1, "batch_size": 8}, transform=spec,
    )  # fmt: skip
    result = train(request, project)
    assert input_size(read_model_info(result.model_dir).transform) == 12
    export_onnx(result.model_dir, sample=digits_split[1])
    session = ort.InferenceSession(str(result.model_dir / ONNX), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape[1:] == [3, 12, 12]
    table = pd.read_csv(score(result.model_dir, digits_split[1], tmp_path / "s.csv", threads=1))
    assert table["Scoring Error"].isna().all() and len(table) == len(
        read_manifest(digits_split[1]).images
    )


# --- Apply Image Transformation ---------------------------------------------------------------


def test_apply_writes_an_image_directory_with_the_same_classes(
    digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    train_dir = digits_split[0]
    source = read_manifest(train_dir)
    transform = init_transformation(
        tmp_path / "t", {"resize_size": 24, "center_crop_size": 20, "pad": True, "padding": 2}
    )
    manifest = apply_transformation(transform, train_dir, tmp_path / "out")

    assert read_manifest(tmp_path / "out") == manifest.whole()
    assert (manifest.labeled, manifest.classes, manifest.counts) == (
        True,
        source.classes,
        source.counts,
    )
    assert [e.label for e in manifest.images] == [e.label for e in source.images]
    for entry in manifest.images:
        file = tmp_path / "out" / entry.path
        assert entry.path.endswith(".png") and file.is_file()
        assert hashlib.sha256(file.read_bytes()).hexdigest() == entry.sha256
        with Image.open(file) as img:
            assert img.size == (entry.width, entry.height) == (24, 24)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        *source.classes,
        "manifest.json",
    ]
    # training reads it like any ImageDirectory
    assert len(ManifestImageFolder(tmp_path / "out", manifest)) == len(source.images)


def test_apply_in_training_mode_is_seeded_per_image(
    digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    val = digits_split[1]
    transform = init_transformation(
        tmp_path / "t", {**SMALL, "random_rotation": True, "random_horizontal_flip": True}
    )
    before = torch.get_rng_state()
    a = apply_transformation(transform, val, tmp_path / "a", mode="training", seed=1)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's random state is untouched
    b = apply_transformation(transform, val, tmp_path / "b", mode="training", seed=1)
    c = apply_transformation(transform, val, tmp_path / "c", mode="training", seed=2)
    inference = apply_transformation(transform, val, tmp_path / "i", mode="inference")
    assert [e.sha256 for e in a.images] == [e.sha256 for e in b.images]
    assert [e.sha256 for e in a.images] != [e.sha256 for e in c.images]
    assert [e.sha256 for e in a.images] != [e.sha256 for e in inference.images]
    assert {(e.width, e.height) for e in a.images} == {(16, 16)}


def test_apply_refuses_a_bad_mode_and_an_output_over_its_input(
    digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    transform = init_transformation(tmp_path / "t", SMALL)
    with pytest.raises(InvalidParameterError, match="mode = 'train', expected one of training"):
        apply_transformation(transform, digits_split[1], tmp_path / "out", mode="train")
    with pytest.raises(InvalidParameterError, match="overlaps the input"):
        apply_transformation(transform, digits_split[1], digits_split[1] / "inside")
    assert not (tmp_path / "out").exists() and not (digits_split[1] / "inside").exists()


# --- one definition: the ModelDirectory's spec drives export and scoring ----------------------


def test_a_model_scores_images_of_another_size_through_its_stored_spec(
    digits_split: tuple[Path, Path], model_classes: list[str], tmp_path: Path
) -> None:
    val = digits_split[1]
    spec = transform_spec(
        resize_size=20, center_crop_size=12, pad=True, padding=2, grayscale=True,
        mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25],
    )  # fmt: skip
    model_dir = make_model_dir(tmp_path / "model", model_classes, transform=spec)
    assert read_model_info(model_dir).transform == spec  # round-trips through model.json
    export_onnx(model_dir, sample=val)  # its parity batch goes through the same spec

    # 40x40 versions of the validation digits: scoring must bring them to 16x16 by the spec.
    for png in val.rglob("*.png"):
        target = tmp_path / "val40" / png.relative_to(val)
        target.parent.mkdir(parents=True, exist_ok=True)
        load_rgb(png).resize((40, 40)).save(target)
    table = pd.read_csv(score(model_dir, tmp_path / "val40", tmp_path / "s.csv", threads=1))
    probs = [f"Scored Probabilities_{c}" for c in model_classes]

    inference = build_transform(spec, "inference")
    batch = torch.stack([inference(load_rgb(tmp_path / "val40" / p)) for p in table["path"]])
    assert batch.shape[1:] == (3, 16, 16)
    session = ort.InferenceSession(str(model_dir / ONNX), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"input": batch.numpy()})
    expected = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(table[probs].to_numpy(), expected, atol=1e-6)


def test_the_demo_spec_is_the_one_params_yaml_holds() -> None:
    import yaml

    from flows.config import DEMO_TRANSFORM, PipelineConfig

    on_disk = yaml.safe_load((ROOT / "params.yaml").read_text())["transform"]
    assert TransformSpec(**on_disk) == DEMO_TRANSFORM == PipelineConfig().transform
    assert input_size(DEMO_TRANSFORM) == 32
    assert not DEMO_TRANSFORM.random_horizontal_flip  # a mirrored digit is not the same digit


def test_workers_import_the_builders_without_prefect() -> None:
    code = (
        "import sys, tasks.data.transform as t; assert 'prefect' not in sys.modules; "
        "from prefect import Task; assert isinstance(t.apply_transformation_task, Task)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
