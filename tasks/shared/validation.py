"""Parameter checking with messages a person can act on: the name, the value and the range.

pydantic knows every field's type and bounds; this turns its ValidationError into one sentence per
bad value (``epochs = 0, expected an integer > 0 (default 5)``) and a hint that says what each bad
parameter is for, read from the same fields the Prefect form shows (one source of truth).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

import annotated_types
from pydantic import BaseModel, ValidationError

from models.bounded_parse import shown
from tasks.shared.errors import InvalidParameterError

M = TypeVar("M", bound=BaseModel)


def checked(cls: type[M], values: Mapping[str, Any], what: str) -> M:
    """``cls(**values)``; a bad value raises InvalidParameterError naming value and range.

    ``what`` names the kind of parameter in the message (``"training parameter"``).
    """
    try:
        return cls(**values)
    except ValidationError as exc:
        message, hint = describe(cls, exc)
        raise InvalidParameterError(f"Invalid {what}: {message}.", hint) from exc


def describe(cls: type[BaseModel], exc: ValidationError) -> tuple[str, str]:
    """(what was wrong, what the bad parameters are for) for a ValidationError of ``cls``."""
    errors = exc.errors()
    names = [str(err["loc"][0]) for err in errors if err["loc"]]
    # A rule across fields (a model validator) names its fields in its message.
    names += [n for err in errors if not err["loc"] for n in cls.model_fields if n in err["msg"]]
    fields = [cls.model_fields[n] for n in dict.fromkeys(names) if n in cls.model_fields]
    if len(set(names) - set(cls.model_fields)) or not fields:
        hint = "Known parameters: " + ", ".join(cls.model_fields) + "."
    else:  # say what each bad parameter is for, as the form would
        hint = " ".join(f"{f.title}: {f.description}" for f in fields)
    return "; ".join(_describe_one(cls, err) for err in errors), hint


def _describe_one(cls: type[BaseModel], err: Any) -> str:
    if not err["loc"]:  # a rule across fields: its own words
        return str(err["msg"]).removeprefix("Value error, ")
    name = str(err["loc"][0])
    value = err.get("input")
    field = cls.model_fields.get(name)
    if field is None:  # extra="forbid"
        return f"unknown parameter {shown(name)} (= {shown(value)})"
    default = field.get_default(call_default_factory=True)
    if len(err["loc"]) > 1 or err["type"] == "model_type":  # an item of a list, a nested model
        where = "".join(f"[{part}]" for part in err["loc"][1:])
        return f"{name}{where} = {shown(value)}: {err['msg'].lower()}"  # the list's default: noise
    return f"{name} = {shown(value)}, expected {expected(field)} (default {default!r})"


def expected(field: Any) -> str:
    """The field's range in words, read from its type and constraints."""
    annotation = field.annotation
    others = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) and len(others) == 1:  # int | None: may be empty
        return f"{_expected(others[0], field.metadata)}, or empty"
    return _expected(annotation, field.metadata)


def _expected(annotation: Any, metadata: list[Any]) -> str:
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(annotation))
    bounds = {type(meta): meta for meta in metadata}
    if typing.get_origin(annotation) is list:
        length = bounds.get(annotated_types.MinLen)
        return f"a list of {length.min_length} numbers" if length else "a list of numbers"
    kind = {int: "an integer", float: "a finite number", bool: "true or false"}.get(
        annotation, str(annotation)
    )
    low, high = bounds.get(annotated_types.Ge), bounds.get(annotated_types.Le)
    if low is not None and high is not None:
        return f"{kind} from {low.ge} to {high.le}"
    words = [
        f"{op} {getattr(bounds[kind_], attr)}"
        for kind_, op, attr in (
            (annotated_types.Gt, ">", "gt"),
            (annotated_types.Ge, ">=", "ge"),
            (annotated_types.Lt, "<", "lt"),
            (annotated_types.Le, "<=", "le"),
        )
        if kind_ in bounds
    ]
    return " ".join([kind, " and ".join(words)]) if words else kind
