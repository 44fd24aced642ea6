"""Pipeline parameters: params.yaml and the typed flow parameters cannot drift apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flows.config import PipelineConfig
from tasks.errors import InvalidParameterError
from tasks.train.params import TrainParams

ROOT = Path(__file__).resolve().parents[1]


def test_params_yaml_equals_the_flow_defaults() -> None:
    on_disk = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert on_disk == PipelineConfig().model_dump(mode="json")
    assert PipelineConfig.from_yaml(ROOT / "params.yaml") == PipelineConfig()


def test_the_demo_keeps_the_seed_training_defaults() -> None:
    train = PipelineConfig().train
    seed = TrainParams()
    for name in ("epochs", "batch_size", "warmup_epochs", "learning_rate", "seed", "patience"):
        assert getattr(train, name) == getattr(seed, name), name
    assert (train.epochs, train.batch_size, train.learning_rate) == (5, 16, 0.001)
    assert (train.seed, train.patience, train.warmup_epochs, train.print_frequency) == (1, 3, 0, 10)
    assert train.nproc_per_node == 2


def test_bad_values_in_a_file_name_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "params.yaml"
    bad.write_text("train:\n  epochs: 0\n")
    with pytest.raises(InvalidParameterError, match=r"train\.epochs"):
        PipelineConfig.from_yaml(bad)
    bad.write_text("trian: {}\n")
    with pytest.raises(InvalidParameterError, match="trian"):
        PipelineConfig.from_yaml(bad)
