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

from models.form_sections import SCHEMA_KEY
from tasks.shared.validation import expected


class CheckedFlow(Flow):
    """A Prefect flow whose parameter check speaks of the form's fields, not of JSON paths."""

    def validate_parameters(self, parameters: dict[str, Any]) -> dict[str, Any]:
        try:
            return super().validate_parameters(parameters)
        except ParameterTypeError:
            # A saved setting the form picked first (its reference, flattened, would read as a
            # field "$ref"), then the values.
            sentences = unloadable_settings(self.fn, parameters) or bad_parameters(
                self.fn, parameters
            )
            if not sentences:
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


def unloadable_settings(fn: Callable[..., Any], parameters: dict[str, Any]) -> list[str]:
    """One plain sentence per saved setting (a block reference a form's picker sent) that
    Prefect cannot load: deleted since, or holding values its type no longer takes."""
    from prefect.blocks.core import Block

    hints = typing.get_type_hints(fn, include_extras=True)
    sentences = []
    for name, value in parameters.items():
        for loc, ref in _block_references(value, ()):
            try:
                Block.load_from_ref(ref, _sync=True)
            except Exception as exc:  # whatever Prefect raised, said in words
                why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                sentences.append(
                    f"{_where(name, hints.get(name), loc)}: the saved setting it names cannot be "
                    f"loaded ({why}); pick another one, or leave it empty for the defaults."
                )
    return sentences


def _block_references(value: Any, loc: tuple[str, ...]) -> typing.Iterator[tuple[tuple, Any]]:
    if isinstance(value, dict):
        if set(value) == {"$ref"}:
            yield loc, value["$ref"]
            return
        for key, item in value.items():
            yield from _block_references(item, (*loc, str(key)))


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
    where, field = _where(name, hint, error["loc"]), _field_at(hint, error["loc"])
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


def _where(name: str, hint: Any, loc: typing.Sequence[Any]) -> str:
    """``Training parameters > Machines and processes``: a place in a parameter, by the titles
    the form shows (a section by its own: models.form_sections)."""
    titles, kind = [_title(hint) or name], _bare(hint)
    for step in loc:
        if not (isinstance(kind, type) and issubclass(kind, BaseModel)):
            break
        field = kind.model_fields.get(str(step))
        if field is None:  # a section of the model, or a field it does not have
            declared = (kind.model_config.get("json_schema_extra") or {}).get(SCHEMA_KEY, [])
            sections = (
                {d["key"]: d["title"] for d in declared} if isinstance(declared, list) else {}
            )
            titles.append(sections.get(str(step), str(step)))
            break
        titles.append(field.title or str(step))
        kind = _bare(field.annotation)
    return " > ".join(titles)


def _field_at(hint: Any, loc: typing.Sequence[Any]) -> FieldInfo | None:
    """The field at ``loc`` in a parameter (None past a field the model does not have)."""
    field, kind = _field_info(hint), _bare(hint)
    for step in loc:
        if not (isinstance(kind, type) and issubclass(kind, BaseModel)):
            break
        field = kind.model_fields.get(str(step))
        if field is None:
            break
        kind = _bare(field.annotation)
    return field


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
