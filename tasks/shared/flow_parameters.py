"""Flows that refuse a bad parameter in words, before any step runs, whatever the run form said.

The server checks a run's parameters against the deployment's form only when the form's "Validate
parameters" box is ticked. Unticked, ``epochs: 0`` reached the worker, and Prefect's own check
failed the run with a traceback naming JSON paths (``params.epochs: Input should be greater than
0``). A :class:`CheckedFlow` fails it with one sentence per bad field instead, the field named by
its title on the form, with the values it takes. Details: docs/deployments.md#bad-values.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from typing import Any

from prefect import Flow
from prefect.exceptions import ParameterTypeError
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from tasks.shared.validation import expected


class CheckedFlow(Flow):
    """A Prefect flow whose parameter check speaks of the form's fields, not of JSON paths."""

    def validate_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        try:
            return super().validate_parameters(parameters)
        except ParameterTypeError:
            sentences = bad_parameters(self.fn, parameters)
            if not sentences:  # not a value's fault (a block reference): Prefect's own words
                raise
            raise ParameterTypeError(
                f"{self.name} refused {len(sentences)} value(s) before running anything:\n- "
                + "\n- ".join(sentences)
                + "\nRun it again with the values corrected."
            ) from None


def checked_flow(**options: Any) -> Callable[[Callable[..., Any]], CheckedFlow]:
    """``@flow(**options)``, as a :class:`CheckedFlow`."""

    def decorate(fn: Callable[..., Any]) -> CheckedFlow:
        return CheckedFlow(fn=fn, **options)

    return decorate


def bad_parameters(fn: Callable[..., Any], parameters: dict[str, Any]) -> list[str]:
    """One plain sentence per value of ``parameters`` that ``fn``'s annotations refuse."""
    hints = typing.get_type_hints(fn, include_extras=True)
    known = inspect.signature(fn).parameters
    sentences = []
    for name, value in parameters.items():
        if name not in known or name not in hints:
            continue
        try:
            TypeAdapter(hints[name]).validate_python(value)
        except ValidationError as exc:
            sentences += [_sentence(name, hints[name], error) for error in exc.errors()]
    return sentences


def _sentence(name: str, hint: Any, error: Any) -> str:
    """``Training parameters > Epochs: 0 is not allowed; it must be an integer > 0 and <= 10000.``
    (the range in the words of :func:`tasks.shared.validation.expected`)."""
    titles, field = [_title(hint) or name], _field_info(hint)
    kind = _bare(hint)
    for step in error["loc"]:
        if not (isinstance(kind, type) and issubclass(kind, BaseModel)):
            break
        field = kind.model_fields.get(str(step))
        if field is None:  # a field the model does not have
            titles.append(str(step))
            break
        titles.append(field.title or str(step))
        kind = _bare(field.annotation)
    where = " > ".join(titles)
    value = error.get("input")
    kind_of = error["type"]
    if kind_of == "missing":
        return f"{where}: a value is needed."
    if kind_of == "extra_forbidden":
        return f"{where}: not a field of this form; leave it out (check its spelling)."
    if kind_of in ("literal_error", "enum"):
        return f"{where}: {value!r} is not one of the choices ({error['ctx']['expected']})."
    if field is not None and _bare(field.annotation) in (int, float, bool):
        return f"{where}: {value!r} is not allowed; it must be {expected(field)}."
    return f"{where}: {value!r} is not allowed ({error['msg'][:1].lower()}{error['msg'][1:]})."


def _field_info(hint: Any) -> FieldInfo | None:
    """The ``Field`` of an ``Annotated[..., Field(...)]`` flow parameter, if it has one."""
    if typing.get_origin(hint) is typing.Annotated:
        return next((m for m in hint.__metadata__ if isinstance(m, FieldInfo)), None)
    return None


def _title(hint: Any) -> str | None:
    field = _field_info(hint)
    return field.title if field is not None else None


def _bare(hint: Any) -> Any:
    """The type under ``Annotated`` and ``| None``."""
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        kinds = [k for k in typing.get_args(hint) if k is not type(None)]
        return _bare(kinds[0]) if len(kinds) == 1 else hint
    return hint
