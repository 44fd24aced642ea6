"""Registration on a real MLflow (SQLite in the project folder): versions, tags, alias, load."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import mlflow.artifacts
import mlflow.pyfunc
import numpy as np
import onnxruntime as ort
import pandas as pd
import pytest
import torch
from mlflow.entities.model_registry import ModelVersion
from mlflow.tracking import MlflowClient
from model_helpers import copy_model, make_model_dir
from projects import imageops

from models.atomic import write_json
from models.directory import ONNX, read_model_info
from tasks.data.imagedir import load_rgb, read_manifest
from tasks.data.transform import build_transform
from tasks.inference.evaluate import evaluate
from tasks.inference.export import sha256_file
from tasks.inference.score import score
from tasks.registry.model_uri import model_in_use
from tasks.registry.register import INCOMPLETE_TAG, register
from tasks.registry.version_description import describe_version
from tasks.shared import faults
from tasks.shared.errors import InvalidParameterError, RegistryError
from tasks.shared.settings import Settings
from tasks.shared.tracking import configure_mlflow

pytest_plugins = ["model_fixtures"]


def _real_batch(model_dir: Path, images: Path, count: int = 6) -> np.ndarray:
    transform = build_transform(read_model_info(model_dir).transform, "inference")
    entries = read_manifest(images).images[:count]
    return torch.stack([transform(load_rgb(images / e.path)) for e in entries]).numpy()


def _trained_in_a_finished_run(
    client: MlflowClient, experiment_id: str, exported_model: Path, dest: Path
) -> tuple[Path, str]:
    """A copy of ``exported_model`` whose model.json names a new FINISHED training run."""
    run_id = client.create_run(experiment_id, run_name="train").info.run_id
    client.set_terminated(run_id)
    model_dir = copy_model(exported_model, dest)
    info = read_model_info(model_dir).model_copy(update={"mlflow_run_id": run_id})
    write_json(model_dir / "model.json", info.model_dump(mode="json"))
    return model_dir, run_id


def test_register_twice_makes_versions_with_tags_and_a_loadable_alias(
    project: Settings, exported_model: Path, digits_split: tuple[Path, Path]
) -> None:
    first = register(exported_model, settings=project, data_version={"train": "a" * 32})
    second = register(
        exported_model,
        settings=project,
        data_version={"train": "b" * 32, "val": "c" * 32},
        alias="champion",
    )
    assert (first.name, first.version, second.version) == ("imageops-classifier", 1, 2)
    assert second.model_uri == "models:/imageops-classifier/2"
    assert first.run_id != second.run_id  # no training run recorded: each gets its own run

    client = MlflowClient()
    version = client.get_model_version("imageops-classifier", "2")
    tags = version.tags
    assert tags["data_md5.train"] == "b" * 32
    assert tags["data_md5.val"] == "c" * 32
    assert tags["git_revision"] == "unknown"  # the test project is not a git repository
    assert float(tags["training_val_top1"]) == 0.5  # training's own figure, labelled so
    assert "val_top1" not in tags  # no figure of the exported model: it was not scored
    assert tags["architecture"] == "resnet18"
    # A readable version list: a dozen tags, the parameters and metrics left in the run.
    assert not any(k.startswith(("param.", "metric.")) for k in tags) and len(tags) <= 12, tags
    assert tags["classes"] == '["0", "1", "2"]'
    assert int(client.get_model_version_by_alias("imageops-classifier", "champion").version) == 2
    artifacts = {a.path for a in client.list_artifacts(second.run_id, "model_directory")}
    assert artifacts == {"model_directory/model.json", "model_directory/model.safetensors"}

    batch = _real_batch(exported_model, digits_split[1])
    local = ort.InferenceSession(str(exported_model / ONNX), providers=["CPUExecutionProvider"])
    (expected,) = local.run(["logits"], {"input": batch})

    # The version's raw ONNX file is the exported one, byte for byte (and gives the same logits).
    folder = Path(mlflow.artifacts.download_artifacts("models:/imageops-classifier@champion"))
    assert (folder / "artifacts" / ONNX).read_bytes() == (exported_model / ONNX).read_bytes()
    assert tags["onnx_sha256"] == sha256_file(folder / "artifacts" / ONNX)
    registered = ort.InferenceSession(
        str(folder / "artifacts" / ONNX), providers=["CPUExecutionProvider"]
    )
    (got,) = registered.run(["logits"], {"input": batch})
    np.testing.assert_array_equal(got, expected)

    # What MLflow loads is the pyfunc: images in (file bytes), labels out.
    pyfunc = mlflow.pyfunc.load_model("models:/imageops-classifier/1")
    assert pyfunc.metadata.get_input_schema().input_names() == ["image"]
    files = [digits_split[1] / e.path for e in read_manifest(digits_split[1]).images[:6]]
    predicted = pyfunc.predict(pd.DataFrame({"image": [f.read_bytes() for f in files]}))
    classes = np.array(["0", "1", "2"])
    assert predicted["Scored Labels"].tolist() == classes[expected.argmax(1)].tolist()
    assert "3 classes: 0, 1, 2" in version.description


def test_register_logs_into_the_training_run_with_the_git_revision(
    project: Settings, exported_model: Path, tmp_path: Path
) -> None:
    git = ["git", "-C", str(project.project_root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (project.project_root / "README.md").write_text("project\n")
    subprocess.run([*git, "add", "README.md"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "init"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True)

    experiment_id = configure_mlflow(project)
    client = MlflowClient()
    model_dir, training_run = _trained_in_a_finished_run(
        client, experiment_id, exported_model, tmp_path / "trained"
    )

    registered = register(model_dir, settings=project)

    assert registered.run_id == training_run
    runs = client.search_runs([experiment_id])
    assert [r.info.run_id for r in runs] == [training_run]  # no second run was opened
    assert runs[0].info.status == "FINISHED"
    version = client.get_model_version(registered.name, str(registered.version))
    assert version.tags["git_revision"] == head.stdout.strip()
    assert version.tags["data_md5.train"] == "0" * 32  # from model.json when not passed
    assert version.run_id == training_run


def test_the_versions_top1_is_what_evaluate_of_the_registered_model_gives(
    project: Settings, exported_model: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    # Issue 46: training validated and recorded one figure, the exported model scored another;
    # the registry showed training's. Registered with its validation set, the version's figures
    # are the exported model's, as score + evaluate of the registered version give them.
    val = digits_split[1]
    with pytest.raises(InvalidParameterError, match=r"validation data .* is not an ImageDirectory"):
        register(exported_model, settings=project, validation=tmp_path)  # refused before logging
    configure_mlflow(project)
    assert MlflowClient().search_registered_models() == []

    registered = register(exported_model, settings=project, validation=val)

    with model_in_use(registered.model_uri, project) as published:
        scored = score(published, val, tmp_path / "val.csv")
    top1 = evaluate(scored, settings=project, log_to_mlflow=False)["accuracy"]
    assert top1 != 0.5  # what training recorded in model.json (the fixture's made-up figure)
    version = MlflowClient().get_model_version(registered.name, str(registered.version))
    assert version.tags["val_top1"] == f"{top1:.4f}"
    assert version.tags["training_val_top1"] == "0.5000"  # kept, labelled as training's
    assert f"(ONNX Runtime, float32): accuracy {top1:.4f}," in version.description
    assert f"validation set `{val.name}`" in version.description
    assert "**Training's own validation** (PyTorch, the kept epoch): " in version.description


def test_register_without_model_onnx_says_to_export_first(
    project: Settings, tmp_path: Path, model_classes: list[str]
) -> None:
    model_dir = make_model_dir(tmp_path / "not-exported", model_classes)
    with pytest.raises(RegistryError, match=r"no model\.onnx.*Run `imageops export .*` first"):
        register(model_dir, settings=project)


def test_register_refuses_an_onnx_exported_from_other_weights(
    project: Settings, exported_model: Path, tmp_path: Path, model_classes: list[str]
) -> None:
    model_dir = copy_model(exported_model, tmp_path / "retrained")
    other = make_model_dir(tmp_path / "other", model_classes, seed=7)
    (model_dir / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    with pytest.raises(RegistryError, match="exported from other weights"):
        register(model_dir, settings=project)
    configure_mlflow(project)  # the tracking URI is process-wide: point it at this project
    assert MlflowClient().search_registered_models() == []


def test_register_refuses_a_reserved_alias_before_logging(
    project: Settings, exported_model: Path
) -> None:
    with pytest.raises(InvalidParameterError, match="'latest'"):
        register(exported_model, settings=project, alias="latest")
    configure_mlflow(project)
    assert MlflowClient().search_registered_models() == []


# The boundaries of `imageops register` (tasks.shared.faults), in order, and what each leaves.
BOUNDARIES = (
    "register.logged_model_created",  # a PENDING logged model, nothing in it yet
    "register.model_logged",  # a READY logged model, no version
    "register.version_created",  # a version tagged incomplete, no description, no alias
    "register.described",  # the alias not moved
    "register.alias_moved",  # all done but the last step (the incomplete tag dropped)
)


def _one_version_complete(
    client: MlflowClient, experiment_id: str, name: str, run_id: str, alias: str
) -> ModelVersion:
    """The run's one version, complete, and its one logged model (READY): nothing else left."""
    (version,) = client.search_model_versions(f"name = '{name}' AND run_id = '{run_id}'")
    assert INCOMPLETE_TAG not in version.tags
    assert version.description.startswith("Image classifier")
    assert client.get_model_version_by_alias(name, alias).version == version.version
    (logged,) = client.search_logged_models([experiment_id], f"source_run_id = '{run_id}'")
    assert (f"models:/{logged.model_id}", logged.status) == (version.source, "READY")
    assert {"MLmodel", "artifacts"} <= {
        a.path for a in client.list_logged_model_artifacts(logged.model_id)
    }
    artifacts = {a.path for a in client.list_artifacts(run_id, "model_directory")}
    assert artifacts == {"model_directory/model.json", "model_directory/model.safetensors"}
    return version


def test_a_killed_register_run_again_completes_one_version_and_the_run_stays_finished(
    project: Settings, exported_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 43 #7: `imageops register` killed, then the same register again, once per boundary:
    each attempt stops at the next boundary, the last completes. The training run keeps its
    FINISHED all along (a killed register left it RUNNING for good), the rerun completes what
    the killed one made (it added a second version and left a PENDING logged model).

    The first attempt is the command, SIGKILLed; the others are in-process, stopped by a raised
    fault: between the boundaries register has no cleanup for the training run (no ``finally``,
    no ``except``), so a raise leaves what a kill leaves, at a fraction of a command's cost."""
    experiment_id = configure_mlflow(project)
    client = MlflowClient()
    name = project.registered_model_name
    model_dir, run_id = _trained_in_a_finished_run(
        client, experiment_id, exported_model, tmp_path / "trained"
    )
    first, *others = BOUNDARIES
    monkeypatch.setenv(faults.FAULT, f"{first}:kill")
    killed = imageops("register", str(model_dir), "--alias", "challenger", cwd=tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert client.get_run(run_id).info.status == "FINISHED"
    (pending,) = client.search_logged_models([experiment_id], f"source_run_id = '{run_id}'")
    assert pending.status == "PENDING"
    for point in others:
        monkeypatch.setenv(faults.FAULT, f"{point}:raise")
        with pytest.raises(faults.InjectedFault):
            register(model_dir, settings=project, alias="challenger")
        assert client.get_run(run_id).info.status == "FINISHED", point
        assert len(client.search_model_versions(f"run_id = '{run_id}'")) <= 1, point
        logged = client.search_logged_models([experiment_id], f"source_run_id = '{run_id}'")
        assert [m.status for m in logged] == ["READY"], point  # the PENDING one is gone
    monkeypatch.delenv(faults.FAULT)

    registered = register(model_dir, settings=project, alias="challenger")

    assert client.get_run(run_id).info.status == "FINISHED"
    version = _one_version_complete(client, experiment_id, name, run_id, "challenger")
    assert (int(version.version), registered.run_id) == (registered.version, run_id)

    # A model no training run recorded gets a run of register's own: the rerun completes the
    # version in that run and ends it FINISHED, instead of a second run and version.
    monkeypatch.setenv(faults.FAULT, "register.version_created:raise")
    with pytest.raises(faults.InjectedFault):
        register(exported_model, settings=project, alias="challenger")
    monkeypatch.delenv(faults.FAULT)
    own = register(exported_model, settings=project, alias="challenger")
    assert client.get_run(own.run_id).info.status == "FINISHED"
    _one_version_complete(client, experiment_id, name, own.run_id, "challenger")
    assert len(client.search_runs([experiment_id])) == 2  # the training run, and this one


def test_the_description_keeps_training_and_validation_figures_apart(exported_model: Path) -> None:
    """Issue 47, finding 11: training's figures were one list under "validation", where
    final/train/loss, train/loss and val/loss stood side by side."""
    figures = {"train/loss": 0.21, "val/loss": 0.35, "val/top1": 0.9, "final/train/loss": 0.2,
               "final/val/top1": 0.88}  # fmt: skip
    info = read_model_info(exported_model).model_copy(update={"metrics": figures})
    text = describe_version(info, "imageops-classifier", 1)
    kept = text.split("**Training's own validation** (PyTorch, the kept epoch): ")[1]
    assert kept.startswith("val/loss 0.3500, val/top1 0.9000. Training, the kept epoch: ")
    assert "Training, the kept epoch: train/loss 0.2100. The last epoch's validation: " in text
    assert "validation: final/val/top1 0.8800. The last epoch's training: final/train/loss " in text
