"""The Prefect UI's run forms: each deployment's parameter schema, titled and described in words.

Prefect builds a deployment's schema from the flow's signature but titles every parameter by its
Python name (``train_data``) and takes descriptions only from a Google-style docstring, so the
``Annotated[..., Field(title=..., description=...)]`` our flows declare never reached the form.
:func:`form_schema` puts them back, and turns the docstring markup pydantic copies into the
schema (``code``, :func:`name`) into plain text: the form shows descriptions as they are.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable
from typing import Any

from pydantic.fields import FieldInfo

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :func:`tasks.x.y` -> tasks.x.y
_CODE = re.compile(r"`{1,2}([^`]+)`{1,2}")  # ``imageops run`` / `resize_size` -> the words
_PLACEHOLDER = re.compile(r"<([\w .-]+)>")  # timm/<name>: the form's Markdown drops it as a tag


def plain_text(text: str) -> str:
    """``text`` without reStructuredText or Markdown code marks, placeholders in braces."""
    return _PLACEHOLDER.sub(r"{\1}", _CODE.sub(r"\1", _ROLE.sub(r"\1", text)))


def form_schema(fn: Callable[..., Any]) -> Any:
    """Prefect's parameter schema of flow function ``fn`` (a ``ParameterSchema``), with each
    parameter's title and description from its ``Annotated`` Field and every description, down
    to the nested models' fields, in plain text."""
    from prefect.utilities.callables import parameter_schema

    fn = getattr(fn, "fn", fn)  # a Prefect Flow: its function
    schema = parameter_schema(fn)
    hints = typing.get_type_hints(fn, include_extras=True)
    for name, prop in schema.properties.items():
        field = _annotated_field(hints.get(name))
        if field is not None and field.title:
            prop["title"] = field.title
        if field is not None and field.description:
            prop["description"] = field.description
    for part in (schema.properties, schema.definitions):
        _plain_descriptions(part)
        _one_input_for_optional(part)
    return schema


def _one_input_for_optional(node: Any) -> None:
    """An optional value (``anyOf: [{type: number}, {type: null}]``) as the value's own schema,
    and no ``null`` in any default.

    Prefect's form draws ``anyOf`` as a switch between the types, ``null`` reading "Property is
    type None"; a field left empty is what people mean by "the recipe's value". Empty fields are
    left out of what the form sends, and the flow's own defaults fill them with None. So a
    ``null`` may not stay in a default either: the form would send it back and its own check
    (the value's type only, now) refuse it.
    """
    if isinstance(node, dict):
        options = node.get("anyOf")
        if isinstance(options, list) and len(options) == 2 and {"type": "null"} in options:
            (value,) = [o for o in options if o != {"type": "null"}]
            # Not a nested model (null there is a real choice: "the data's transform"), nor a
            # switch: a toggle cannot be left empty, and would send false for "the recipe's".
            if ("type" in value or "enum" in value) and value.get("type") != "boolean":
                del node["anyOf"]
                node.update(value)
        if "default" in node:
            node["default"] = _without_nulls(node["default"])
            if node["default"] is None and "anyOf" not in node:  # a kept choice keeps its null
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


def _annotated_field(hint: Any) -> FieldInfo | None:
    if typing.get_origin(hint) is typing.Annotated:
        return next((m for m in typing.get_args(hint)[1:] if isinstance(m, FieldInfo)), None)
    return None


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
