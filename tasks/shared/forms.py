"""The Prefect UI's run forms: each deployment's parameter schema, titled and described in words.

Prefect builds a deployment's schema from the flow's signature but titles every parameter by its
Python name (``train_data``) and takes descriptions only from a Google-style docstring: a plain
``Annotated[..., Field(title=..., description=...)]`` never reaches the form. A flow parameter
declared with :func:`form_field` carries both in ``json_schema_extra``, which Prefect keeps, so
Prefect's own ``prefect deploy`` gets them too. :func:`form_schema` (what ``imageops serve`` and
``python -m app.deployments`` register) also turns the docstring markup pydantic copies into the
nested models' descriptions (``code``, :func:`name`) into plain text, draws an optional value
as one input that may be left empty or set back to None, and groups a model's fields into the
sections it declares (models.form_sections), basics first.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

from pydantic import Field

from models.form_sections import SCHEMA_KEY

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :func:`tasks.x.y` -> tasks.x.y
_CODE = re.compile(r"`{1,2}([^`]+)`{1,2}")  # ``imageops run`` / `resize_size` -> the words
_PLACEHOLDER = re.compile(r"<([\w .-]+)>")  # timm/<name>: the form's Markdown drops it as a tag


def plain_text(text: str) -> str:
    """``text`` without reStructuredText or Markdown code marks, placeholders in braces."""
    return _PLACEHOLDER.sub(r"{\1}", _CODE.sub(r"\1", _ROLE.sub(r"\1", text)))


def form_field(*, title: str, description: str, **constraints: Any) -> Any:
    """A flow parameter's ``Field`` whose title and description reach the deployment's form,
    whichever way the deployment is registered (``json_schema_extra`` survives Prefect's own
    schema, which overrides ``title`` with the parameter's name)."""
    text = plain_text(description)
    return Field(
        title=title,
        description=text,
        json_schema_extra={"title": title, "description": text},
        **constraints,
    )


def form_schema(fn: Callable[..., Any]) -> Any:
    """Prefect's parameter schema of flow function ``fn`` (a ``ParameterSchema``), every
    description, down to the nested models' fields, in plain text, and optional values as one
    input."""
    from prefect.utilities.callables import parameter_schema

    schema = parameter_schema(getattr(fn, "fn", fn))  # a Prefect Flow: its function
    _sectioned(schema.properties, schema.definitions)
    for part in (schema.properties, schema.definitions):
        _plain_descriptions(part)
        _one_input_for_optional(part)
        _mixed_lists_as_json(part)
    return schema


def _mixed_lists_as_json(node: Any) -> None:
    """A list whose items may be of several types (a tuning spec's categorical values:
    ``["sgd", "adamw"]``, ``[16, 32]``) as one JSON input, not a switch between types on every
    item; the flow checks each value (tasks.shared.flow_parameters)."""
    if isinstance(node, dict):
        items = node.get("items")
        if node.get("type") == "array" and isinstance(items, dict) and "anyOf" in items:
            del node["type"], node["items"]
        for value in node.values():
            _mixed_lists_as_json(value)
    elif isinstance(node, list):
        for item in node:
            _mixed_lists_as_json(item)


def _sectioned(properties: dict[str, Any], definitions: dict[str, Any]) -> None:
    """Each model that declares sections: its basic fields, then one object per section; the
    defaults shown for it (at any depth: the pipeline's config holds two such models) grouped
    alike, so the form fills every card."""
    sections = {
        name: definition.pop(SCHEMA_KEY)
        for name, definition in definitions.items()
        if SCHEMA_KEY in definition
    }
    if not sections:
        return

    def model_of(node: dict[str, Any]) -> str | None:
        refs = [node, *node.get("allOf", []), *node.get("anyOf", [])]
        for ref in refs:
            if isinstance(ref, dict) and "$ref" in ref:
                return ref["$ref"].rsplit("/", 1)[-1]
        return None

    def grouped(value: Any, name: str | None) -> Any:
        if name is None or not isinstance(value, dict) or name not in definitions:
            return value
        fields = definitions[name].get("properties", {})
        value = {k: grouped(v, model_of(fields.get(k, {}))) for k, v in value.items()}
        for section in sections.get(name, ()):
            part = {f: value.pop(f) for f in section["fields"] if f in value}
            value[section["key"]] = part
        return value

    for node in [*properties.values(), *(
        p for d in definitions.values() for p in d.get("properties", {}).values()
    )]:  # fmt: skip
        if "default" in node:
            node["default"] = grouped(node["default"], model_of(node))
    for name, declared in sections.items():
        definition = definitions[name]
        fields = definition["properties"]
        moved = {f for section in declared for f in section["fields"]}
        regrouped = {k: v for k, v in fields.items() if k not in moved}
        for section in declared:
            regrouped[section["key"]] = {
                "type": "object",
                "title": section["title"],
                "description": section["description"],
                "properties": {f: fields[f] for f in section["fields"]},
            }
        definition["properties"] = regrouped
        # The model takes its fields flat too (params.yaml's shape, `prefect deployment run -p
        # 'params={"momentum": 0.8}'`): the server checks them as well, by name. The form draws
        # only ``properties``.
        definition["patternProperties"] = {
            f"^{re.escape(f)}$": copy.deepcopy(fields[f]) for f in sorted(moved)
        }


def _one_input_for_optional(node: Any) -> None:
    """An optional value (``anyOf: [{type: number}, {type: null}]``) as one input, and no
    ``null`` in any default.

    Prefect's form draws ``anyOf`` as a switch between the types, ``null`` reading "Property is
    type None"; a field left empty is what people mean by "the recipe's value". Empty fields are
    left out of what the form sends, and the flow's own defaults fill them with None. So a
    ``null`` may not stay in a default either: the form would send it back and its own check
    (the value's type only, now) refuse it. A choice (an enum, or yes/no) is a select, and a
    select cannot be emptied once set: its options start with None, which the form sends as
    null. An optional nested model is the model: its "none" is a parameter of its own
    (the train deployment's "Train with the data's own transform").
    """
    if isinstance(node, dict):
        options = node.get("anyOf")
        if isinstance(options, list) and len(options) == 2 and {"type": "null"} in options:
            (value,) = [o for o in options if o != {"type": "null"}]
            del node["anyOf"]
            if value.get("type") == "boolean":
                node["enum"] = [None, True, False]
            elif "enum" in value:  # no type: the form's select then offers None (null) too
                node["enum"] = [None, *value["enum"]]
            else:
                node.update(value)
        if "default" in node:
            node["default"] = _without_nulls(node["default"])
            if node["default"] is None:
                del node["default"]
        for value in node.values():
            _one_input_for_optional(value)
    elif isinstance(node, list):
        for item in node:
            _one_input_for_optional(item)


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _plain_descriptions(node: Any) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "description" and isinstance(value, str):
                node[key] = plain_text(value)
            else:
                _plain_descriptions(value)
    elif isinstance(node, list):
        for item in node:
            _plain_descriptions(item)
