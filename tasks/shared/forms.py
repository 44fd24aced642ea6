"""The Prefect UI's run forms: each deployment's parameter schema, titled and described in words.

Prefect builds a deployment's schema from the flow's signature but titles every parameter by its
Python name (``train_data``) and takes descriptions only from a Google-style docstring: a plain
``Annotated[..., Field(title=..., description=...)]`` never reaches the form. A flow parameter
declared with :func:`form_field` carries both in ``json_schema_extra``, which Prefect keeps, so
Prefect's own ``prefect deploy`` gets them too. :func:`form_schema` (what ``imageops serve`` and
``python -m app.deployments`` register) also turns the docstring markup pydantic copies into the
nested models' descriptions (``code``, :func:`name`) into plain text, and draws an optional value
as one input that may be left empty.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pydantic import Field

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
            # Not a nested model (null there is a real choice: "the data's transform"). A switch
            # cannot be left empty (it would send false for "the recipe's"): a yes/no/empty
            # choice instead, which the form draws as a select.
            if value.get("type") == "boolean":
                del node["anyOf"]
                node["enum"] = [True, False]
            elif "type" in value or "enum" in value:
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
