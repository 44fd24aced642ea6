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


def plain_text(text: str) -> str:
    """``text`` without reStructuredText or Markdown code marks."""
    return _CODE.sub(r"\1", _ROLE.sub(r"\1", text))


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
    _plain_descriptions(schema.properties)
    _plain_descriptions(schema.definitions)
    return schema


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
