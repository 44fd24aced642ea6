"""deployments/prefect.yaml names flows that exist: a typo there fails here, not on a worker."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prefect import Flow

ROOT = Path(__file__).resolve().parents[1]
SPEC = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())


@pytest.mark.parametrize("deployment", SPEC["deployments"], ids=lambda d: d["name"])
def test_every_entrypoint_is_a_flow_that_takes_the_parameters(deployment: dict) -> None:
    # Module paths: a worker imports the installed package, wherever its working folder is.
    module, _, name = deployment["entrypoint"].rpartition(".")
    flow = getattr(importlib.import_module(module), name)
    assert isinstance(flow, Flow)
    accepted = set(flow.parameters.properties)
    given = set(deployment.get("parameters") or {})
    for trigger in deployment.get("triggers", []):
        given |= set(trigger.get("parameters") or {})
    assert given <= accepted, f"{deployment['name']}: unknown parameters {given - accepted}"


def _fields(schema: dict) -> list[tuple[str, dict]]:
    """Every field a form shows: the parameters and, section by section, the models' fields."""
    fields = [(name, prop) for name, prop in schema["properties"].items()]

    def within(prefix: str, properties: dict) -> None:
        for key, prop in properties.items():
            fields.append((f"{prefix}.{key}", prop))
            within(f"{prefix}.{key}", prop.get("properties", {}))  # a section's own fields

    for model, definition in schema.get("definitions", {}).items():
        within(model, definition.get("properties", {}))
    return fields


def _switches(node: object, path: str = "") -> list[str]:
    """Where the form would draw a switch between types (anyOf), outside a dict's values."""
    found = []
    if isinstance(node, dict):
        if "anyOf" in node:
            found.append(path)
        for key, value in node.items():
            if key != "additionalProperties":
                found += _switches(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, item in enumerate(node):
            found += _switches(item, f"{path}[{index}]")
    return found


@pytest.mark.parametrize("deployment", SPEC["deployments"], ids=lambda d: d["name"])
def test_every_form_field_has_a_title_in_words_and_a_plain_description(deployment: dict) -> None:
    """What the Prefect UI's form shows for each field: the deployment's own parameter schema
    (Prefect alone titles parameters by their Python names and leaves descriptions out)."""
    from app.deployments import runner_deployment

    built = runner_deployment(deployment, [])
    schema = built._parameter_openapi_schema.model_dump_for_openapi()
    for name, prop in _fields(schema):
        title = prop.get("title") or ""
        assert title and not re.fullmatch(r"[a-z0-9_]+", title), f"{name}: title {title!r}"
        assert prop.get("description"), f"{deployment['name']}: {name} has no description"
    text = repr(schema)
    for markup in ("``", ":func:", ":class:", ":mod:"):
        assert markup not in text, f"{deployment['name']}: {markup} shown raw"
    assert "<" not in text.replace("<=", "")  # the form's Markdown would drop <name> as a tag
    # No switch between types anywhere on the form (an optional value, a list of mixed values):
    # Prefect draws anyOf as one. A dict's values (additionalProperties) are one JSON input.
    assert not _switches(schema), f"{deployment['name']}: type switches at {_switches(schema)}"
    if deployment["name"] == "train":
        assert schema["properties"]["train_data"]["title"] == "Training data"
        assert schema["properties"]["train_data"]["description"].startswith("Labeled")
        # An optional number is one input, left empty for the recipe's value: no type switch,
        # and no null in the defaults the form would send back.
        params = schema["definitions"]["TrainParams"]["properties"]
        picked = params["recipe_options"]["allOf"][0]["$ref"].rsplit("/", 1)[-1]
        options = schema["definitions"][picked]["properties"]
        assert "anyOf" not in options["momentum"] and options["momentum"]["type"] == "number"
        assert "default" not in options["momentum"]
        assert "momentum" not in schema["properties"]["params"]["default"]
        # A choice set once can be set back to None (the recipe's): the select offers it first.
        assert options["decay_norm_and_bias"]["enum"] == [None, True, False]
        assert options["optimizer"]["enum"] == [None, "sgd", "adamw", "adam", "rmsprop"]
        # The transform is one card; "the data's" is a switch of its own, not a null transform.
        assert schema["properties"]["data_transform"]["type"] == "boolean"


def _order(properties: dict) -> list[str]:
    return list(properties)


def test_the_train_form_shows_the_basics_first_then_a_saved_setting_per_section() -> None:
    """The form's order: the training's basics (epochs, batch, recipe, learning rate), then one
    picker each for the recipe's options and the machines; the transform's sizes, then pickers
    for what training alone does and the normalisation. A picker is a Prefect block type whose
    fields are the section's, so the block's own form titles and checks them. The same on the
    pipeline's form (one TrainParams, one TransformSpec), which fits a few screens for it."""
    from flows.pipeline import pipeline
    from flows.saved_settings import SAVED_SETTINGS
    from flows.train import train_model_flow
    from tasks.shared.forms import form_schema

    def block_of(field: dict) -> dict:
        return definitions[field["allOf"][0]["$ref"].rsplit("/", 1)[-1]]

    for flow in (train_model_flow, pipeline):
        schema = form_schema(flow).model_dump_for_openapi()
        definitions = schema["definitions"]
        train = definitions["TrainParams"]["properties"]
        assert _order(train)[:4] == ["epochs", "batch_size", "recipe", "learning_rate"]
        assert _order(train)[-2:] == ["recipe_options", "distribution"]
        assert train["distribution"]["title"] == "Machines and processes"
        machines = block_of(train["distribution"])
        assert machines["block_type_slug"] == "imageops-distribution"
        assert "nproc_per_node" in machines["properties"]
        assert "nproc_per_node" not in train  # on the form only through the saved setting
        transform = definitions["TransformSpec"]["properties"]
        assert _order(transform)[:4] == ["resize", "resize_size", "center_crop", "center_crop_size"]
        assert _order(transform)[-2:] == ["training_augmentation", "normalisation"]
        assert "random_crop" in block_of(transform["training_augmentation"])["properties"]
        # The block types the server registers are these very fields, checked the same way.
        for field in (train["recipe_options"], train["distribution"]):
            slug = block_of(field)["block_type_slug"]
            drawn = set(block_of(field)["properties"]) - {"$ref"}  # that one: see forms.py
            assert set(SAVED_SETTINGS[slug].model_fields) == drawn
    # What an empty picker means is on the form: the demo's values, by title.
    params = form_schema(train_model_flow).model_dump_for_openapi()["properties"]["params"]
    assert "Machines and processes left empty: Processes per node 2" in params["description"]


def test_what_the_form_sends_grouped_trains_what_the_same_values_flat_do() -> None:
    """The form sends each card as an object (Prefect draws nothing else as a group); the flow
    takes that and the flat shape params.yaml and the API use, to the same parameters. A value
    in a card wins over the same field given flat (the run's demo defaults fill in flat)."""
    from flows.train import train_model_flow

    grouped = {
        "params": {
            "epochs": 2,
            "recipe_options": {"optimizer": None, "decay_norm_and_bias": True},
            "distribution": {"nproc_per_node": 1},
        },
        "transform": {"resize_size": 40, "training_augmentation": {"random_crop": True}},
    }
    flat = {
        "params": {"epochs": 2, "decay_norm_and_bias": True, "nproc_per_node": 1},
        "transform": {"resize_size": 40, "random_crop": True},
    }
    from_form = train_model_flow.validate_parameters(grouped)
    assert from_form == train_model_flow.validate_parameters(flat)
    assert from_form["params"].nproc_per_node == 1  # the demo's 2 is flat: the card's 1 wins
    assert from_form["params"].optimizer is None and from_form["transform"].random_crop


def test_a_saved_setting_picked_on_the_form_trains_what_it_holds() -> None:
    """A section's picker sends a block reference, which Prefect loads into the block before
    the flow's parameters are checked: its fields, as saved (a new one's own defaults for
    those left alone), win over the demo's; no picker keeps the demo's."""
    from flows.saved_settings import SAVED_SETTINGS
    from flows.train import train_model_flow

    machines = SAVED_SETTINGS["imageops-distribution"](nproc_per_node=3)
    recipe = SAVED_SETTINGS["imageops-recipe-options"](optimizer="sgd", schedule="step")
    picked = train_model_flow.validate_parameters(
        {"params": {"epochs": 2, "distribution": machines, "recipe_options": recipe}}
    )["params"]
    assert (picked.epochs, picked.nproc_per_node, picked.optimizer, picked.schedule) == (
        2, 3, "sgd", "step",
    )  # fmt: skip
    assert picked.momentum is None  # left empty in the block: the recipe's
    untouched = {"params": {"distribution": SAVED_SETTINGS["imageops-distribution"]()}}
    assert train_model_flow.validate_parameters(untouched)["params"].nproc_per_node == 1
    assert train_model_flow.validate_parameters({"params": {}})["params"].nproc_per_node == 2


@pytest.mark.parametrize("deployment", SPEC["deployments"], ids=lambda d: d["name"])
def test_prefect_deploy_titles_and_describes_every_parameter_too(deployment: dict) -> None:
    """`prefect deploy --prefect-file deployments/prefect.yaml` builds the schema itself, with
    Prefect's own calls (load the entrypoint, ``parameter_schema``): the same titles and
    descriptions as the deployments imageops registers (whose descriptions then say what a
    section's empty picker means: Prefect's own form draws the sections' fields instead)."""
    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema

    from app.deployments import runner_deployment

    theirs = parameter_schema(load_flow_from_entrypoint(deployment["entrypoint"]))
    ours = runner_deployment(deployment, [])._parameter_openapi_schema
    for name, prop in theirs.properties.items():
        assert prop["title"] == ours.properties[name]["title"], name
        assert ours.properties[name]["description"].startswith(prop["description"]), name


def test_the_promote_and_score_deployments_are_there() -> None:
    names = {d["name"] for d in SPEC["deployments"]}
    assert {"pipeline", "train", "tune", "tune-trial", "promote", "score"} <= names


def test_a_broken_deployments_file_or_entry_is_a_clear_error(tmp_path: Path) -> None:
    from app.deployments import load_spec, runner_deployment
    from tasks.shared.errors import ImageOpsError

    broken = tmp_path / "prefect.yaml"
    broken.write_text("deployments: [unclosed")
    with pytest.raises(ImageOpsError, match=r"Cannot read .*prefect\.yaml"):
        load_spec(broken)
    broken.write_text("name: x\n")
    with pytest.raises(ImageOpsError, match="no `deployments:` list"):
        load_spec(broken)
    (entry,) = [d for d in SPEC["deployments"] if d["name"] == "promote"]
    with pytest.raises(ImageOpsError, match=r"options \['work_queue'\] are not registered"):
        runner_deployment({**entry, "work_queue": "x"}, [])
    with pytest.raises(ImageOpsError, match="only cron schedules"):
        runner_deployment({**entry, "schedules": [{"interval": 60}]}, [])


def test_serve_refuses_a_busy_port_before_starting_anything(tmp_path: Path) -> None:
    import socket

    from app.stack import Ports, Stack
    from tasks.shared.errors import ImageOpsError
    from tasks.shared.settings import Settings

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        stack = Stack(
            Settings(project_root=tmp_path, home=tmp_path / ".imageops"),
            ports=Ports(prefect=port, mlflow=port + 1, receiver=port + 2),
        )
        with pytest.raises(ImageOpsError, match=rf"Prefect port {port}\b.*on 127.0.0.1 is in use"):
            stack.start()
    assert stack.services == []
    assert not (tmp_path / ".imageops" / "stack").exists()


def test_the_readme_names_every_deployment_as_prefect_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each deployment's full name, in the deployments page's table and in one `prefect deployment
    run` (docs/deployments.md, the README's section before the docs site)."""
    from app.deployments import main

    main(["--list"])  # `python -m app.deployments --list`: flow names from the @flow decorators
    defined = set(capsys.readouterr().out.split())
    assert "imageops-train-model/train" in defined and len(defined) == len(SPEC["deployments"])
    section = (ROOT / "docs" / "deployments.md").read_text()
    assert section.startswith("# Deployments and operations\n")
    table = set(re.findall(r"^\| `([\w-]+/[\w-]+)` \|", section, flags=re.MULTILINE))
    examples = re.findall(r"^prefect deployment run ([\w-]+/[\w-]+) ", section, flags=re.MULTILINE)
    assert table == defined
    assert sorted(examples) == sorted(defined)  # one example each
    # Elsewhere in the README and the docs too, `prefect deployment run` names only deployments
    # that exist.
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for text in (page.read_text() for page in pages):
        assert set(re.findall(r"prefect deployment run ([\w-]+/[\w-]+)", text)) <= defined


def _without(key: str, node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without(key, v) for k, v in node.items() if k != key}
    if isinstance(node, list):
        return [_without(key, v) for v in node]
    return node


def test_a_picked_saved_setting_passes_the_checks_of_the_form_and_the_server() -> None:
    """A picker's value is a block reference: Prefect's check (the server's, and the UI's,
    which drops ``additionalProperties`` first) takes it, as it takes a section typed as an
    object, and still refuses a bad value in one."""
    from prefect.utilities.schema_tools.validation import validate

    from flows.train import train_model_flow
    from tasks.shared.forms import form_schema

    schema = form_schema(train_model_flow).model_dump_for_openapi()
    picked = {"$ref": {"block_document_id": "9e944346-d267-484b-a542-5be4d0478c11"}}
    for checked_as in (schema, _without("additionalProperties", schema)):
        for good in (
            {"params": {"epochs": 2, "distribution": picked, "recipe_options": picked}},
            {"params": {"recipe_options": {"momentum": 0.5}}},
            {"transform": {"training_augmentation": picked}},
        ):
            assert validate(good, checked_as) == [], good
        bad = validate({"params": {"recipe_options": {"momentum": 1.5}}}, checked_as)
        assert bad and "1.5" in str(bad[0].message), bad
