"""One definition of the training request: every parameter reaches every entry point.

TrainParams (Train PyTorch Model) and ModelChoice (DenseNet / ResNet) are the definitions; the
CLI options, the Prefect forms, params.yaml and the DVC stages are read from them, so a new
parameter is added once.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlflow
import pytest
import yaml
from projects import imageops

from flows.config import PipelineConfig
from models.transform_spec import TransformSpec
from models.untrained import ModelChoice, resnet, write_untrained
from tasks.data.transform import init_transformation
from tasks.shared.errors import InvalidParameterError
from tasks.shared.settings import Settings
from tasks.train.params import MAX_BATCH_SIZE, MAX_EPOCHS, TrainParams, TrialHook
from tasks.train.request import TrainRequest

pytest_plugins = ["model_fixtures"]

ROOT = Path(__file__).resolve().parents[1]


def _option(field: str) -> str:
    return "--" + field.replace("_", "-")


@pytest.mark.parametrize(
    ("command", "model"), [(("train",), TrainParams), (("model", "build"), ModelChoice)]
)
def test_every_field_is_an_option_of_the_cli(tmp_path: Path, command: tuple, model: type) -> None:
    result = imageops(*command, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for name, field in model.model_fields.items():
        assert _option(name) in result.stdout, name
        assert field.title in result.stdout, name  # its help is the field's


def test_every_field_is_in_the_prefect_forms() -> None:
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import pipeline
    from flows.train import train_model_flow

    for flow, train_key, model_key in (
        (train_model_flow, "params", "model"),
        (pipeline, "config", "config"),
    ):
        schema = parameter_schema(flow).model_dump()
        definitions = schema["definitions"]
        assert set(TrainParams.model_fields) <= set(definitions["TrainParams"]["properties"])
        assert set(ModelChoice.model_fields) <= set(definitions["ModelChoice"]["properties"])
        assert {train_key, model_key} <= set(schema["properties"])


def test_the_forms_show_the_epoch_and_batch_limits() -> None:
    """The limits a request is checked against are the forms' maximums: a server refuses 10^12
    epochs before any worker starts."""
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import pipeline
    from flows.train import train_model_flow

    for flow in (pipeline, train_model_flow):
        fields = parameter_schema(flow).model_dump()["definitions"]["TrainParams"]["properties"]
        assert fields["epochs"]["maximum"] == MAX_EPOCHS
        assert fields["batch_size"]["maximum"] == MAX_BATCH_SIZE
        assert f"{MAX_EPOCHS:,}" in fields["epochs"]["description"]
        assert f"{MAX_BATCH_SIZE:,}" in fields["batch_size"]["description"]


def test_params_yaml_and_the_dvc_stages_take_every_field() -> None:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert set(params["train"]) == set(TrainParams.model_fields)
    assert set(params["model"]) == set(ModelChoice.model_fields)
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    # the stages read whole sections (--config), not a hand-kept list of ${train.x}
    assert "--config params.yaml" in stages["train"]["cmd"] and "${" not in stages["train"]["cmd"]
    assert stages["train"]["params"] == ["train"]
    assert "--config params.yaml" in stages["model"]["cmd"]
    assert stages["model"]["params"] == ["model"]


def test_cli_options_override_the_config_and_reach_the_run(
    project: Settings, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    """recipe (over the file's azure), momentum, precision and loader workers from the command
    line; the rest from params.yaml; all of them in the MLflow run, with what the recipe filled
    in."""
    config = PipelineConfig().model_dump(mode="json")
    config["train"].update(weight_decay=0.003, patience=2, epochs=1, recipe="azure")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(config))
    untrained = write_untrained(resnet("resnet18", pretrained=False), tmp_path / "untrained")
    init_transformation(tmp_path / "transform", {"resize_size": 16, "center_crop_size": 16})
    result = imageops(
        "train", str(untrained), *map(str, digits_split), str(tmp_path / "model"),
        "--config", "params.yaml", "--momentum", "0.5", "--precision", "fp32",
        "--num-workers", "0", "--device", "cpu", "--transform", "transform",
        "--recipe", "modern", "--accumulation-steps", "2", "--ema-decay", "0.9", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (run_id,) = re.findall(r"MLflow run: (\w+)", result.stdout)
    params = mlflow.MlflowClient(project.tracking_uri).get_run(run_id).data.params
    assert (params["momentum"], params["precision"], params["num_workers"]) == ("0.5", "fp32", "0")
    assert (params["weight_decay"], params["patience"]) == ("0.003", "2")  # from the file
    assert params["nproc_per_node"] == "2"  # the file's (the demo), not the Azure default
    # what the recipe filled in where neither the file nor the options set a value
    assert (params["recipe"], params["optimizer"], params["schedule"]) == (
        "modern",
        "adamw",
        "cosine",
    )
    assert (params["learning_rate"], params["warmup_epochs"], params["label_smoothing"]) == (
        "0.001",
        "1",
        "0.1",
    )
    assert params["decay_norm_and_bias"] == "False"
    assert params["accumulation_steps"] == "2"  # DDP on 2 processes, reducing every 2nd batch
    assert params["ema_decay"] == "0.9"  # the average is what was validated and exported
    assert (params["transform.augmentation"], params["transform.random_erasing"]) == (
        "randaugment",
        "True",
    )
    rrc = [params[f"transform.random_resized_crop{k}"] for k in ("", "_size", "_scale")]
    assert rrc == ["True", "16", "0.5"]  # at the input size the transform gives
    model_json = json.loads((tmp_path / "model" / "model.json").read_text())
    assert model_json["transform"]["augmentation_magnitude"] == 21  # the model records it too
    assert model_json["transform"]["random_resized_crop_size"] == 16
    assert model_json["train_params"]["optimizer"] == "adamw"


def test_model_build_takes_every_model_option(tmp_path: Path) -> None:
    result = imageops(
        "model", "build", "m", "--name", "densenet121", "--no-pretrained", "--memory-efficient",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    spec = yaml.safe_load((tmp_path / "m" / "model.json").read_text())
    assert (spec["arch"], spec["memory_efficient"], spec["pretrained"]) == (
        "densenet121",
        True,
        False,
    )
    refused = imageops("model", "build", "r", "--name", "resnet18", "--memory-efficient",
                       cwd=tmp_path)  # fmt: skip
    assert refused.returncode == 2 and "memory_efficient applies to DenseNets" in refused.stderr
    assert not (tmp_path / "r").exists()


def test_register_takes_a_model_name(
    project: Settings, exported_model: Path, tmp_path: Path
) -> None:
    model = shutil.copytree(exported_model, tmp_path / "model")
    result = imageops("register", str(model), "--name", "digits-net", "--alias", "challenger",
                      cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "registered digits-net version 1" in result.stdout
    client = mlflow.MlflowClient(project.tracking_uri, project.registry_uri)
    assert str(client.get_model_version_by_alias("digits-net", "challenger").version) == "1"


def _job(transform: TransformSpec | Path) -> TrainRequest:
    """A tuning trial's 2-node cluster job: every kind of field set."""
    hook = TrialHook(study_name="s", trial_number=3, metric="val/top1", early_stopping=True)
    return TrainRequest(
        model=Path("outputs/x/untrained"), train_data=Path("data/digits/train"),
        val_data=Path("data/digits/val"), out=Path("outputs/x/model"),
        params={"epochs": 2, "nodes": 2, "learning_rate": 0.03, "cluster": "10.0.0.5:6379",
                "rdzv_timeout_s": 60},
        transform=transform, data_version={"train": "0" * 32}, run_id="run-1", tuning=hook,
        env={"CUDA_VISIBLE_DEVICES": "1"},
    )  # fmt: skip


@pytest.mark.parametrize(
    "transform", [TransformSpec(resize_size=32, center_crop_size=32), Path("transforms/t")]
)
def test_the_train_flow_gets_the_request_whole_as_its_one_parameter(
    transform: TransformSpec | Path,
) -> None:
    from prefect.utilities.callables import parameter_schema

    from flows.train import train_flow

    job = _job(transform)
    assert set(parameter_schema(train_flow).properties) == {"request"}
    # The request as a Prefect server stores a flow run's parameters (JSON).
    sent = json.loads(json.dumps({"request": job.model_dump(mode="json")}))
    assert train_flow.validate_parameters(sent)["request"] == job


@pytest.mark.parametrize(
    ("given", "error"),
    [
        ({"params": {"epochs": 0}}, "epochs = 0, expected an integer > 0"),
        (
            {"params": {"epochs": 10**12}},
            f"epochs = 1000000000000, expected an integer > 0 and <= {MAX_EPOCHS}",
        ),
        (
            {"params": {"batch_size": 10**9}},
            f"batch_size = 1000000000, expected an integer > 0 and <= {MAX_BATCH_SIZE}",
        ),
        ({"params": {"nodes": 2, "cluster": None}}, "nodes = 2 needs a Ray cluster"),
        ({"params": {"nodes": 2, "cluster": "h:6379", "rdzv_timeout_s": 0}}, "rdzv_timeout_s = 0"),
        ({"params": {"cluster": "h:6379", "cluster_timeout_s": -1}}, "cluster_timeout_s = -1"),
        ({"max_restarts": -1}, "max_restarts = -1, expected an integer >= 0"),
    ],
)
def test_an_invalid_request_is_refused_when_it_is_built(given: dict, error: str) -> None:
    values = {**_job(Path("t")).model_dump(), "params": {"nodes": 2, "cluster": "h:1"}, **given}
    with pytest.raises(InvalidParameterError, match=re.escape(error)):
        TrainRequest.checked(**values)


def test_the_cli_refuses_an_invalid_request_with_one_error_before_reading_anything(
    tmp_path: Path,
) -> None:
    options = ("--nodes", "2")
    result = imageops("train", "nowhere", "t", "v", "out", *options, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("error: InvalidParameterError") == 1, result.stderr
    assert "nodes = 2 needs a Ray cluster" in result.stderr and "--cluster" in result.stderr
    assert "nowhere" not in result.stderr  # the model folder was never looked at
