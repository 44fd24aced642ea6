"""Pipeline parameters: params.yaml and the typed flow parameters cannot drift apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flows.config import PipelineConfig
from tasks.shared.errors import InvalidParameterError
from tasks.train.params import TrainParams

ROOT = Path(__file__).resolve().parents[1]


def test_params_yaml_equals_the_flow_defaults() -> None:
    on_disk = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert on_disk == PipelineConfig().model_dump(mode="json")
    assert PipelineConfig.from_yaml(ROOT / "params.yaml") == PipelineConfig()


def test_the_demo_keeps_the_seed_training_defaults() -> None:
    train = PipelineConfig().train.resolved()  # the recipe fields left empty: modern's values
    default = TrainParams().resolved()
    assert (train.recipe, train.optimizer, train.schedule) == ("modern", "adamw", "cosine")
    for name in ("epochs", "batch_size", "warmup_epochs", "learning_rate", "seed", "patience"):
        assert getattr(train, name) == getattr(default, name), name
    assert (train.epochs, train.batch_size, train.learning_rate) == (5, 16, 0.001)
    assert (train.seed, train.patience, train.warmup_epochs, train.print_frequency) == (1, 3, 1, 10)
    assert train.nproc_per_node == 2
    # the Azure component's exact values stay one field away
    azure = PipelineConfig.checked({"train": {"recipe": "azure"}}, "test", "").train.resolved()
    assert (azure.optimizer, azure.schedule, azure.warmup_epochs) == ("sgd", "poly", 0)
    assert azure.nproc_per_node == 2


def test_bad_values_in_a_file_name_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "params.yaml"
    bad.write_text("train:\n  epochs: 0\n")
    with pytest.raises(InvalidParameterError, match=r"train\.epochs"):
        PipelineConfig.from_yaml(bad)
    bad.write_text("trian: {}\n")
    with pytest.raises(InvalidParameterError, match="trian"):
        PipelineConfig.from_yaml(bad)


def test_a_partial_section_keeps_the_demo_values_not_the_class_defaults(tmp_path: Path) -> None:
    """params.yaml with one training key, the Prefect form's validation of a partial object."""
    from flows.pipeline import pipeline
    from flows.train import train_model_flow

    partial = tmp_path / "params.yaml"
    one_key_each = {
        "train": {"epochs": 2},
        "transform": {"resize_size": 40},
        "model": {"name": "resnet34"},
    }
    partial.write_text(yaml.safe_dump(one_key_each))
    config = PipelineConfig.from_yaml(partial)
    assert (config.train.epochs, config.train.nproc_per_node) == (2, 2)  # the class says 1
    assert (config.transform.resize_size, config.transform.center_crop_size) == (40, 32)
    assert not config.transform.random_horizontal_flip  # the class flips
    assert (config.model.name, config.model.pretrained) == ("resnet34", False)
    # What Prefect's engine does with a run's parameters before the flow starts.
    given = train_model_flow.validate_parameters({"params": {"epochs": 2, "nproc_per_node": 1}})
    assert (given["params"].epochs, given["params"].nproc_per_node) == (2, 1)  # given wins
    given = pipeline.validate_parameters({"config": {"train": {"epochs": 3}}})
    assert given["config"].train == TrainParams(epochs=3, nproc_per_node=2)
