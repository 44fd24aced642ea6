"""What a study may tune, and each tuned parameter checked against the field it sets.

A tuned parameter sets a training parameter (a TrainParams field), the architecture, or a
network option. Its type must fit the field's (an int field takes ``integer``, ``discrete`` or
``categorical`` ints, a float ``double``, ``discrete`` or ``categorical``, a bool or a choice
``categorical`` values it allows) and every bound and value must be one the field accepts.
TrainParams is read when asked, so a field added there is tunable within its range.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic.fields import FieldInfo

from models.bounded_parse import shown
from models.untrained import FAMILIES, Family, ModelChoice
from tasks.shared.errors import InvalidParameterError, InvalidTuningSpecError
from tasks.shared.validation import expected
from tasks.train.params import TrainParams

if TYPE_CHECKING:
    from tasks.tune.parameters import ParameterSpec, Value

ARCHITECTURE = "architecture"
# The network's options (TuningSpec fields, for build_model), each for the family that has it.
MODEL_OPTIONS = ("pretrained", "memory_efficient", "zero_init_residual")
# Each family's own switch, and the family that has it.
FAMILY_OPTIONS = {f.switch: f for f in FAMILIES.values() if f.switch}
# Training parameters no trial can vary, and why.
FIXED = {
    "nodes": "a trial trains on one node (torchrun --standalone); several trials use several "
    "machines",
    "cluster": "where a job runs is not a hyperparameter",
    "cluster_timeout_s": "a wait, not a hyperparameter",
    "rdzv_timeout_s": "a wait, not a hyperparameter",
}


def tunable() -> tuple[str, ...]:
    """What a study may tune: TrainParams' fields but FIXED, the architecture, network options.

    Read from TrainParams when asked, so a field added there is tunable; each parameter spec is
    checked against its field's type and range (:func:`check_parameter`).
    """
    fields = (name for name in TrainParams.model_fields if name not in FIXED)
    return (*fields, ARCHITECTURE, *MODEL_OPTIONS)


TUNABLE = tunable()


def train_with(train: TrainParams, values: Mapping[str, Value]) -> TrainParams:
    """``train`` with a trial's tuned values; refused like any training parameter."""
    tuned = {k: v for k, v in values.items() if k in TrainParams.model_fields}
    return TrainParams.checked(**{**train.model_dump(), **tuned})


def check_model_name(name: object, where: str) -> None:
    if not isinstance(name, str) or not any(f.has(name) for f in FAMILIES.values()):
        raise InvalidTuningSpecError(
            f"{where}: {shown(name)} is not an architecture of the zoo.",
            "Choose torchvision networks by name (`imageops model list`) or timm/<name>.",
        )


def _field(name: str) -> FieldInfo:
    """The field a tuned parameter sets: a training parameter, or a network option."""
    return TrainParams.model_fields.get(name) or ModelChoice.model_fields[name]


def _kind(name: str) -> Literal["int", "float", "bool", "choice"]:
    """What values a parameter takes, from its field's type (``int | None``: an int)."""
    if name == ARCHITECTURE:
        return "choice"
    annotation = _field(name).annotation
    others = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) and len(others) == 1:
        annotation = others[0]
    kinds: dict[Any, Literal["int", "float", "bool"]] = {int: "int", float: "float", bool: "bool"}
    return kinds.get(annotation, "choice")  # a Literal, a string, ...: a list of values


def _allowed(name: str) -> str:
    """What a parameter takes, in words (its field's type and range)."""
    if name == ARCHITECTURE:
        return "a torchvision network's name (`imageops model list`) or timm/<name>"
    return expected(_field(name))


def check_parameter(param: ParameterSpec) -> None:
    """The parameter against its field: a type that fits, values and bounds within its range.

    Its shape (bounds or values, scale, order) is the parameter type's own check.
    """
    name, kind = param.name, param.type
    where = f"Parameter {shown(name)}"
    if name in FIXED:
        raise InvalidTuningSpecError(
            f"{where} cannot vary between trials: {FIXED[name]}.",
            f"Set it in the spec's train section. Tunable: {', '.join(tunable())}.",
        )
    if name not in tunable():
        raise InvalidTuningSpecError(
            f"{where} is not a training parameter that can be tuned.",
            f"Tunable: {', '.join(tunable())}.",
        )
    field_kind = _kind(name)
    if field_kind in ("bool", "choice"):
        _check_choices(param, field_kind)
        return
    if kind == "double" and field_kind == "int":
        raise InvalidTuningSpecError(
            f"{where} is an integer training parameter: it cannot be a double.",
            "Use type integer, discrete or categorical.",
        )
    if kind == "integer" and field_kind == "float":
        raise InvalidTuningSpecError(
            f"{where} takes fractions: use type double (or discrete) rather than integer."
        )
    if kind in ("double", "integer"):
        assert param.min is not None and param.max is not None
        candidates: list[tuple[str, Value]] = [("min", param.min), ("max", param.max)]
    else:
        words = [v for v in param.values or [] if isinstance(v, str | bool)]
        if words:
            raise InvalidTuningSpecError(
                f"{where} takes numbers; got {shown(words)}.",
                "Write numbers without quotes (1e-4 and 0.0001 both read as numbers).",
            )
        candidates = [("value", v) for v in param.values or []]
    for label, value in candidates:
        if field_kind == "int" and isinstance(value, float) and value.is_integer():
            value = int(value)
        _check_in_range(name, label, value)


def _check_choices(param: ParameterSpec, field_kind: str) -> None:
    """A bool, Literal or other non-numeric parameter: categorical, each value one it takes."""
    name, where = param.name, f"Parameter {shown(param.name)}"
    if param.type != "categorical":
        raise InvalidTuningSpecError(
            f"{where} takes {_allowed(name)}: it must be categorical.",
            f"type: categorical, values: [...] ({_allowed(name)}).",
        )
    for value in param.values or []:
        if name == ARCHITECTURE:
            check_model_name(value, where)
        elif field_kind == "bool" and not isinstance(value, bool):
            raise InvalidTuningSpecError(
                f"{where} is true or false; got {shown(value)}.",
                "values: [true, false], without quotes.",
            )
        elif name in TrainParams.model_fields:
            _check_in_range(name, "value", value)


def _check_in_range(name: str, label: str, value: Value) -> None:
    """``value`` is one the training takes for ``name`` (validated by TrainParams itself)."""
    try:
        TrainParams.checked(**{name: value})
    except InvalidParameterError as exc:
        raise InvalidTuningSpecError(
            f"Parameter {shown(name)}: {label} = {shown(value)} is out of range; {name} takes "
            f"{_allowed(name)}.",
            exc.hint,
        ) from exc


def check_family(option: str, trained: list[str], family: Family, where: str, tuned: bool) -> None:
    """``option`` (a family's switch) is on only where trials train that family."""
    outside = [a for a in trained if a not in family.archs]
    if outside:
        kind = f"{family.title}s"
        raise InvalidTuningSpecError(
            f"{where}: {option} applies to {kind} only, and trials may train {outside}.",
            f"Make {option} a child of architecture (parent: architecture, parent_values: "
            f"[the {kind}]), or tune only {kind}."
            if tuned
            else f"Set {option} to false, or train only {kind} (model, architecture's values).",
        )
