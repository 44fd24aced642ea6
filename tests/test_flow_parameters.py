"""Bad values in a flow run's parameters are refused in words, before any step runs (issue 47,
point 2): one sentence per bad field, named by its title on the run form, with what it takes."""

from __future__ import annotations

import pytest
from prefect.exceptions import ParameterTypeError

from tasks.shared.flow_parameters import bad_parameters


def test_each_bad_field_gets_a_sentence_with_its_title_and_range() -> None:
    from flows.train import train_model_flow

    said = bad_parameters(
        train_model_flow.fn,
        {
            "params": {"epochs": 0, "momentum": 1.5, "optimizer": "adagrad"},
            "train_data": "",
            "model": {"name": "resnet18", "pretrainde": True},
        },
    )
    assert said == [
        "Training parameters > Epochs: 0 is not allowed; it must be an integer > 0 and <= 10000.",
        "Training parameters > Optimizer: 'adagrad' is not one of the choices ('sgd', 'adamw', "
        "'adam' or 'rmsprop').",
        "Training parameters > Momentum: 1.5 is not allowed; it must be a finite number >= 0 "
        "and < 1, or empty.",
        "Training data: '' is not allowed (string should have at least 1 character).",
        "Model > pretrainde: not a field of this form; leave it out (check its spelling).",
    ]
    assert bad_parameters(train_model_flow.fn, {"params": {"epochs": 3}}) == []


def test_a_flow_called_with_a_bad_value_runs_no_step(prefect_api: None) -> None:
    """The same check where Prefect makes it, when a flow run starts (a worker's, or a call)."""
    from flows.train import train_model_flow

    with pytest.raises(ParameterTypeError) as refused:
        train_model_flow(params={"epochs": 0})
    message = str(refused.value)
    assert message.startswith("imageops-train-model refused 1 value(s) before running anything:")
    assert "- Training parameters > Epochs: 0 is not allowed" in message
    assert "params.epochs" not in message


def test_a_saved_setting_deleted_since_the_form_picked_it_is_said_in_words(
    prefect_api: None,
) -> None:
    """A run whose picker named a saved setting (a block) that has been deleted since, as a
    'Run again' of an older run does: the flow refuses it before any step, naming the picker by
    its title, not with Prefect's "Failed to resolve block references" or a field "$ref"."""
    from prefect.blocks.core import Block

    from flows.saved_settings import SAVED_SETTINGS
    from flows.train import train_model_flow

    setting = SAVED_SETTINGS["imageops-distribution"](nproc_per_node=1)
    kept = setting.save("kept-machines", overwrite=True)
    gone = SAVED_SETTINGS["imageops-distribution"](nproc_per_node=3)
    gone_id = gone.save("deleted-machines", overwrite=True)
    Block.delete("imageops-distribution/deleted-machines")

    picked = train_model_flow.validate_parameters(
        {"params": {"distribution": {"$ref": {"block_document_id": str(kept)}}}}
    )
    assert picked["params"].nproc_per_node == 1
    with pytest.raises(ParameterTypeError) as refused:
        train_model_flow.validate_parameters(
            {"params": {"distribution": {"$ref": {"block_document_id": str(gone_id)}}}}
        )
    said = str(refused.value)
    where = "Training parameters > Machines and processes"
    assert f"{where}: the saved setting it names cannot be loaded" in said, said
    assert "pick another one, or leave it empty" in said
    assert "$ref" not in said
