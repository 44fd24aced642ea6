"""The registered model as an MLflow consumer uses it: MLflow's own client and server, real digits.

One version is registered as ``@champion`` for the module; every test reaches it the way a
consumer would (``mlflow.pyfunc.load_model``, ``mlflow models serve``, the artifact download),
never through imageops, and holds the answers to ``imageops score``'s on the same images.
"""

from __future__ import annotations

import base64
import io
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import httpx
import mlflow
import mlflow.pyfunc
import numpy as np
import onnxruntime as ort
import pandas as pd
import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from PIL import Image
from projects import use_project
from server_processes import Processes, base_env, free_port, healthy

from models.directory import ONNX, read_model_info
from tasks.data.imagedir import load_rgb, read_manifest
from tasks.data.transform import build_transform
from tasks.inference.score import score
from tasks.registry.register import register
from tasks.shared.settings import Settings
from tasks.shared.tracking import configure_mlflow

pytest_plugins = ["model_fixtures"]

NAME = "imageops-classifier"
CHAMPION = f"models:/{NAME}@champion"
LABEL, ERR = "Scored Labels", "Scoring Error"
PROBS = ["Scored Probabilities_0", "Scored Probabilities_1", "Scored Probabilities_2"]
PATH_HOOK = "imageops-venv-bin.pth"  # what `make install` adds to the environment


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory, exported_model: Path) -> Iterator[Settings]:
    """A project whose registry holds the exported digits model as version 1, ``@champion``."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        settings = use_project(tmp_path_factory.mktemp("consumer") / "project", monkeypatch)
        register(exported_model, settings=settings, alias="champion")
        yield settings


@pytest.fixture
def champion(registry: Settings) -> Settings:
    configure_mlflow(registry)  # MLflow's tracking URI is process-wide: point it here again
    return registry


def _imageops_scores(model: Path, images: Path, dest: Path) -> pd.DataFrame:
    table = pd.read_csv(
        score(model, images, dest), dtype={LABEL: str, ERR: str}, keep_default_na=False
    )
    assert (table[ERR] == "").all()
    return table


def _same_answers(predicted: pd.DataFrame, scored: pd.DataFrame) -> None:
    assert list(predicted.columns) == [*PROBS, LABEL]
    assert predicted[LABEL].tolist() == scored[LABEL].tolist()
    np.testing.assert_allclose(predicted[PROBS].to_numpy(), scored[PROBS].to_numpy(), atol=1e-6)


def test_the_champion_labels_image_files_as_imageops_score_does(
    champion: Settings, exported_model: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    val = digits_split[1]
    files = [val / e.path for e in read_manifest(val).images]  # score's row order
    scored = _imageops_scores(exported_model, val, tmp_path / "scores.csv")

    model = mlflow.pyfunc.load_model(CHAMPION)
    predicted = model.predict(pd.DataFrame({"image": [f.read_bytes() for f in files]}))

    _same_answers(predicted, scored)


def test_the_champion_labels_decoded_arrays_of_another_size_as_imageops_score_does(
    champion: Settings, exported_model: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    # The same scans, 37x29 (not the network's 16x16): the model resizes and crops them itself.
    val = digits_split[1]
    folder = tmp_path / "resized"
    folder.mkdir()
    arrays = []
    for i, entry in enumerate(read_manifest(val).images):
        image = load_rgb(val / entry.path).resize((37, 29), Image.Resampling.BICUBIC)
        image.save(folder / f"{i:03d}.png")  # lossless: the file holds the array's pixels
        arrays.append(np.asarray(image))
    scored = _imageops_scores(exported_model, folder, tmp_path / "scores.csv")

    predicted = mlflow.pyfunc.load_model(CHAMPION).predict(pd.DataFrame({"image": arrays}))

    _same_answers(predicted, scored)


def test_the_version_says_what_it_takes_and_returns_and_keeps_the_raw_onnx(
    champion: Settings, exported_model: Path, digits_split: tuple[Path, Path]
) -> None:
    model = mlflow.pyfunc.load_model(CHAMPION)
    inputs = model.metadata.get_input_schema().to_dict()
    assert inputs == [{"type": "binary", "name": "image", "required": True}]
    outputs = [c["name"] for c in model.metadata.get_output_schema().to_dict()]
    assert outputs == [*PROBS, LABEL]
    # The stored example is what a consumer copies: image files of two sizes, answered in full.
    example = model.input_example
    assert [Image.open(io.BytesIO(b)).size for b in example["image"]] == [(16, 16), (32, 19)]
    answer = model.predict(example)
    assert list(answer.columns) == outputs and len(answer) == 2
    config = model.model_config
    assert config["classes"] == ["0", "1", "2"]
    assert (config["resize"], config["center_crop"], config["input_size"]) == (16, 16, 16)

    version = MlflowClient().get_model_version_by_alias(NAME, "champion")
    for words in ("3 classes: 0, 1, 2", "`image`", "16x16", "val/top1 0.5", "Scored Labels"):
        assert words in version.description

    local = Path(mlflow.artifacts.download_artifacts(CHAMPION))
    requirements = (local / "requirements.txt").read_text().split()
    assert {r.split("==")[0] for r in requirements} == {
        "mlflow",
        "onnxruntime",
        "numpy",
        "pandas",
        "pillow",
    }
    # The raw network is still there for ONNX Runtime users: normalised tensors in, logits out.
    val = digits_split[1]
    transform = build_transform(read_model_info(exported_model).transform, "inference")
    batch = np.stack(
        [transform(load_rgb(val / e.path)).numpy() for e in read_manifest(val).images[:4]]
    )
    raw = ort.InferenceSession(str(local / "artifacts" / ONNX), providers=["CPUExecutionProvider"])
    ours = ort.InferenceSession(str(exported_model / ONNX), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(
        raw.run(["logits"], {"input": batch})[0], ours.run(["logits"], {"input": batch})[0]
    )


def test_values_that_are_not_an_image_are_refused_with_an_error_naming_them(
    champion: Settings, digits_split: tuple[Path, Path]
) -> None:
    model = mlflow.pyfunc.load_model(CHAMPION)
    scan = np.asarray(load_rgb(next(digits_split[1].rglob("*.png"))))
    # Scaled to [0, 1] (or normalised): scoring them would give confident wrong labels.
    with pytest.raises(MlflowException, match=r"image 0 has float32 pixels from 0 to 1.*uint8"):
        model.predict(pd.DataFrame({"image": [scan.astype(np.float32) / 255]}))
    with pytest.raises(MlflowException, match=r"image 1 is a str"):
        model.predict(pd.DataFrame({"image": [scan, "digit.png"]}))
    with pytest.raises(MlflowException, match=r"image 0 has shape \(3, 16, 16\)"):
        model.predict(pd.DataFrame({"image": [np.ascontiguousarray(scan.transpose(2, 0, 1))]}))
    with pytest.raises(MlflowException, match=r"image 1 is not a readable image file.*PNG"):
        model.predict(pd.DataFrame({"image": [scan, b"\x89PNG not really"]}))
    # Gray and RGBA arrays are images too, read as their files would be.
    gray, rgba = scan[..., 0], np.dstack([scan, np.full(scan.shape[:2], 255, np.uint8)])
    answer = model.predict(pd.DataFrame({"image": [gray, rgba]}))
    assert answer[LABEL].isin(["0", "1", "2"]).all()


def test_mlflow_models_serve_answers_posted_images_without_the_environment_on_path(
    champion: Settings,
    exported_model: Path,
    digits_split: tuple[Path, Path],
    tmp_path: Path,
    processes: Processes,
) -> None:
    # As a user runs it without activating the environment: `.venv/bin/mlflow models serve`,
    # with a PATH that has no .venv/bin (MLflow starts `uvicorn` by name).
    hook = Path(sysconfig.get_path("purelib")) / PATH_HOOK
    assert hook.is_file(), f"{hook} is missing: run `make install` to add it to the environment"
    port = free_port()
    env = {k: v for k, v in base_env().items() if k != "PYTHONPATH"}
    env |= {"PATH": "/usr/bin:/bin", "MLFLOW_TRACKING_URI": champion.tracking_uri}
    mlflow_cli = str(Path(sys.executable).parent / "mlflow")
    serve = ["models", "serve", "-m", CHAMPION, "--env-manager", "local"]
    processes.start(
        "mlflow-models-serve", [mlflow_cli, *serve, "-h", "127.0.0.1", "-p", str(port)], env
    )
    url = f"http://127.0.0.1:{port}"
    processes.wait("mlflow models serve", lambda: healthy(f"{url}/ping"), timeout_s=120)

    val = digits_split[1]
    files = [val / e.path for e in read_manifest(val).images]
    scored = _imageops_scores(exported_model, val, tmp_path / "scores.csv")
    # The documented request: the `image` column in pandas' split orient, files in base64.
    body = {
        "dataframe_split": {
            "columns": ["image"],
            "data": [[base64.b64encode(f.read_bytes()).decode()] for f in files],
        }
    }
    answer = httpx.post(f"{url}/invocations", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    predicted = pd.DataFrame(answer.json()["predictions"])
    _same_answers(predicted, scored)

    wrong = httpx.post(
        f"{url}/invocations",
        json={"dataframe_split": {"columns": ["pixels"], "data": [["x"]]}},
        timeout=60,
    )
    assert wrong.status_code == 400 and "image" in wrong.json()["message"]
    gif = base64.b64encode(b"GIF89a").decode()  # not a format the model reads
    garbage = {"dataframe_split": {"columns": ["image"], "data": [[gif]]}}
    refused = httpx.post(f"{url}/invocations", json=garbage, timeout=60)
    assert refused.status_code == 400
    assert "image 0 is not a readable image file" in refused.json()["message"]
