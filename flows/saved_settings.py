"""Saved settings: parts of a run form as Prefect block types, picked on the form by name.

A form shows a model's basic fields; each of its sections (models.form_sections: the recipe
options, the machines and processes, the training augmentation, the normalisation) is one input
that picks a saved block of the section's type, and an optional model (the tune flow's study and
transform) one input that picks a whole saved one or stays empty. The Prefect UI makes them (the
picker's Add, or the Blocks page), each field titled, described and checked as on the model
itself, since the block's fields are the model's. A run loads the block it was given (Prefect
resolves the reference before the flow starts, so flows/__init__ imports this module: a worker
knows the types whichever flow it runs).
"""

from __future__ import annotations

import copy
from typing import Any

from prefect.blocks.core import Block
from pydantic import BaseModel

from flows.config import PipelineConfig
from models.form_sections import SCHEMA_KEY, WHOLE_KEY, FormSection
from models.transform_spec import TransformSpec
from models.untrained import ModelChoice
from tasks.shared.forms import drawn_plainly, every_node
from tasks.train.params import TrainParams
from tasks.tune.spec import TuningSpec

# The models a run form draws with pickers (BaseModels): their sections, or themselves whole.
ON_THE_FORMS: tuple[type[BaseModel], ...] = (
    PipelineConfig, ModelChoice, TrainParams, TransformSpec, TuningSpec,
)  # fmt: skip


def _declared(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_config.get("json_schema_extra") or {}  # type: ignore[return-value]


def _schema_drawn_as_the_run_forms(cls: type[Block], *args: Any, **kwargs: Any) -> dict:
    """The block's schema (its form) drawn as the run forms are, nested models too: no switch
    between a value and None, and a nested model titled as its field, not as its class."""
    schema = Block.model_json_schema.__func__(cls, *args, **kwargs)  # type: ignore[attr-defined]
    drawn_plainly(schema)
    _titled_as_fields(schema)
    _choices_as_selects(schema)
    return schema


def _choices_as_selects(schema: Any) -> None:
    """An optional choice as a select with an empty option, on the block's form.

    The Blocks forms are drawn by Prefect's older schema form, unlike the run forms: a choice
    without a type (the run forms' select with None, tasks.shared.forms) is a JSON box there,
    and a select whose options hold null shows that one alone. A typed select of the values
    offers "None" itself; a yes-or-empty choice is a select of "true" and "false" (pydantic
    reads the words), since a switch cannot be empty and the form always sends it.
    """
    for node in every_node(schema):
        enum = node.get("enum")
        if isinstance(enum, list) and "type" not in node and None in enum:
            values = [v for v in enum if v is not None]
            if all(isinstance(v, bool) for v in values):
                node["type"], node["enum"] = "string", ["true", "false"]
            else:
                node["type"], node["enum"] = "string", values


def _titled_as_fields(schema: Any) -> None:
    for node in every_node(schema):
        if "$ref" in node and len(node) > 1:  # {$ref, title, ...}: the form shows the class's
            node["allOf"] = [{"$ref": node.pop("$ref")}]


def _block_type(
    model: type[BaseModel], fields: tuple[str, ...], slug: str, title: str, description: str
) -> type[Block]:
    """A Block whose fields are ``fields`` of ``model``: the same types, limits and words."""
    infos = {name: model.model_fields[name] for name in fields}
    name = "".join(word.title() for word in slug.removeprefix("imageops-").split("-"))
    namespace = {
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": description,
        "__annotations__": {field: info.annotation for field, info in infos.items()},
        "model_json_schema": classmethod(_schema_drawn_as_the_run_forms),
        **{field: copy.copy(info) for field, info in infos.items()},
        "_block_type_name": f"imageops {title.lower()}",
        "_block_type_slug": slug,
        "_description": f"{description} The {title} input of imageops's run forms picks one of "
        "these by name; a run takes all its fields as saved.",
    }
    return type(name, (Block,), namespace)


def _saved_settings() -> dict[str, type[Block]]:
    found = {}
    for model in ON_THE_FORMS:
        declared = _declared(model)
        for part in declared.get(SCHEMA_KEY, ()):
            section = FormSection(*(part[f] for f in FormSection._fields))
            found[section.block_type] = _block_type(
                model, section.fields, section.block_type, section.title, section.description
            )
        if WHOLE_KEY in declared:
            title = declared[WHOLE_KEY].removeprefix("imageops-").replace("-", " ").capitalize()
            found[declared[WHOLE_KEY]] = _block_type(
                model, tuple(model.model_fields), declared[WHOLE_KEY], title,
                (model.__doc__ or "").split("\n")[0],
            )  # fmt: skip
    return found


SAVED_SETTINGS: dict[str, type[Block]] = _saved_settings()


def register_saved_settings() -> list[str]:
    """Make the block types known to the Prefect server (PREFECT_API_URL): its Blocks page then
    offers them, and the run forms' pickers list the saved ones. Returns their slugs."""
    for block in SAVED_SETTINGS.values():
        block.register_type_and_schema()
    return list(SAVED_SETTINGS)
