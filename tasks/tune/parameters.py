"""One tuned parameter, by type (Vertex AI's ParameterSpec): a pydantic union on ``type``.

``double``/``integer`` (a range and a scale), ``categorical`` (distinct values), ``discrete``
(increasing values and a scale); a conditional child names its ``parent`` and ``parent_values``. A
refusal is a pydantic error of type :data:`REFUSED` carrying message and hint. Every type reads
``min``, ``max``, ``scale``, ``values`` alike. Details: docs/tuning.md#parameters.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from models.bounded_parse import shown
from tasks.shared.errors import InvalidTuningSpecError
from tasks.tune.tunable import TUNABLE

# bool first: pydantic's smart union keeps True a bool (int would take it too).
Value = bool | int | float | str
Scale = Literal["linear", "log", "reverse_log"]
REFUSED = "tuning_parameter"  # the pydantic error type of a parameter refused with a hint
# What every parameter records, whatever its type (the study's identity, the MLflow run).
RECORD = ("name", "type", "min", "max", "scale", "values", "parent", "parent_values")
SCALE = Field(
    "linear",
    title="Scale",
    description="How values are sampled: linear; log (uniform in log space, min > 0); "
    "reverse_log (denser near max, min > 0).",
)


def refused(message: str, hint: str = "") -> PydanticCustomError:
    """A parameter's shape refused: the message and hint an InvalidTuningSpecError will carry."""
    return PydanticCustomError(REFUSED, "{message}", {"message": message, "hint": hint})


class _Parameter(BaseModel):
    """What every tuned parameter has: the field it sets and, if conditional, its parent."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    RANGED: ClassVar[bool] = False

    name: str = Field(
        title="Training parameter",
        description="Any training parameter but nodes, the architecture, or a network option: "
        f"{', '.join(TUNABLE)}.",
    )
    parent: str | None = Field(
        None,
        title="Parent",
        description="Tune this parameter only when this (earlier, non-double) parameter takes "
        "one of parent_values.",
    )
    parent_values: list[Value] | None = Field(
        None, title="Parent values", description="The parent's values that switch this one on."
    )

    @model_validator(mode="before")
    @classmethod
    def _bounds_or_values(cls, data: Any) -> Any:
        """A range has min and max and no values; a list has values and no min or max."""
        if not isinstance(data, Mapping):
            return data
        where, kind = f"Parameter {shown(data.get('name'))}", data.get("type")
        has_range = data.get("min") is not None and data.get("max") is not None
        if cls.RANGED and (not has_range or data.get("values") is not None):
            raise refused(
                f"{where} ({kind}) needs min and max, and no values.",
                "Give min and max; use type categorical or discrete for a list of values.",
            )
        listed = data.get("min") is not None or data.get("max") is not None
        if not cls.RANGED and (not data.get("values") or listed):
            raise refused(
                f"{where} ({kind}) needs a non-empty list of values, and no min or max.",
                "Give values: [...]; use type double or integer for a range.",
            )
        return data

    def record(self) -> dict[str, Any]:
        """Every parameter's fields, None where its type has none (the shape of the identity)."""
        return {key: getattr(self, key) for key in RECORD}

    def training_value(self, internal: Any) -> Value:
        """The value trained with, from the value Optuna holds (see :mod:`tasks.tune.spec`)."""
        return internal

    def grid_values(self) -> list[Value]:
        """Every value a grid visits (in Optuna's terms)."""
        return list(self.values or [])

    def _check_scale(self, numbers: list[float]) -> None:
        if self.scale != "linear" and min(numbers) <= 0:
            raise refused(
                f"Parameter {shown(self.name)} has a {self.scale} scale, which needs values > 0; "
                f"its minimum is {min(numbers):g}.",
                "Raise min above 0, or use scale linear.",
            )


class _Range(_Parameter):
    RANGED: ClassVar[bool] = True
    values: ClassVar[None] = None

    min: float = Field(title="Minimum", description="The range's lower bound.")
    max: float = Field(title="Maximum", description="The range's upper bound.")
    scale: Scale = SCALE

    @model_validator(mode="after")
    def _ordered(self) -> _Range:
        where = f"Parameter {shown(self.name)}"
        if self.type == "integer" and not (self.min.is_integer() and self.max.is_integer()):
            raise refused(
                f"{where} is an integer range: min = {self.min:g} and max = {self.max:g} must "
                "be whole numbers.",
                "Round min and max, or make the parameter a double.",
            )
        if self.min >= self.max:
            raise refused(
                f"{where}: min = {self.min:g} must be below max = {self.max:g}.",
                "Swap min and max, or make the range wider.",
            )
        self._check_scale([self.min, self.max])
        return self

    def training_value(self, internal: Any) -> Value:
        if self.scale == "reverse_log":
            # Clamped: float rounding must not step past a bound (momentum < 1).
            internal = min(max(self.min + self.max - internal, self.min), self.max)
        return internal


class DoubleParameter(_Range):
    """A real number in [min, max]."""

    type: Literal["double"] = Field(title="Type", description="double: a range of real numbers.")

    def grid_values(self) -> list[Value]:
        raise InvalidTuningSpecError(
            f"Parameter {shown(self.name)} is a double: it has no grid.",
            "Use algorithm bayesian or random, or make it discrete (a list of values).",
        )


class IntegerParameter(_Range):
    """A whole number in [min, max]."""

    type: Literal["integer"] = Field(title="Type", description="integer: a range of integers.")

    def training_value(self, internal: Any) -> Value:
        return round(super().training_value(internal))

    def grid_values(self) -> list[Value]:
        return list(range(int(self.min), int(self.max) + 1))


class _Listed(_Parameter):
    min: ClassVar[None] = None
    max: ClassVar[None] = None

    values: list[Value] = Field(title="Values", description="The values a trial may take.")

    @model_validator(mode="after")
    def _distinct(self) -> _Listed:
        if len({(type(v), v) for v in self.values}) != len(self.values):
            raise refused(
                f"Parameter {shown(self.name)} lists a value twice: {shown(self.values)}.",
                "List each value once.",
            )
        return self


class CategoricalParameter(_Listed):
    """One of a set of values (numbers, words, true/false), unordered."""

    scale: ClassVar[Scale] = "linear"

    type: Literal["categorical"] = Field(title="Type", description="categorical: a set of values.")

    @model_validator(mode="before")
    @classmethod
    def _no_scale(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("scale", "linear") != "linear":
            raise refused(
                f"Parameter {shown(data.get('name'))} is categorical: its values have no scale.",
                "Leave scale out, or make it discrete (increasing numbers) to give one.",
            )
        return {k: v for k, v in data.items() if k != "scale"} if isinstance(data, dict) else data


class DiscreteParameter(_Listed):
    """One of increasing numbers, sampled on a scale."""

    type: Literal["discrete"] = Field(title="Type", description="discrete: increasing numbers.")
    scale: Scale = SCALE

    @model_validator(mode="after")
    def _increasing(self) -> DiscreteParameter:
        if any(isinstance(v, str | bool) for v in self.values):
            return self  # words: refused against the field (tasks.tune.tunable), saying so
        numbers = [float(v) for v in self.values]
        if any(b <= a for a, b in itertools.pairwise(numbers)):
            raise refused(
                f"Parameter {shown(self.name)} is discrete: its values must increase; got "
                f"{shown(self.values)}.",
                "Sort the values and drop duplicates.",
            )
        self._check_scale(numbers)
        return self


ParameterSpec = Annotated[
    DoubleParameter | IntegerParameter | CategoricalParameter | DiscreteParameter,
    Field(discriminator="type"),
]
PARAMETER_TYPES = (DoubleParameter, IntegerParameter, CategoricalParameter, DiscreteParameter)


def default_parameters() -> list[ParameterSpec]:
    """The example study's: a learning rate on a log scale, three batch sizes."""
    return [
        DoubleParameter(name="learning_rate", type="double", min=1e-4, max=0.1, scale="log"),
        DiscreteParameter(name="batch_size", type="discrete", values=[8, 16, 32]),
    ]


def check_parent(param: ParameterSpec, seen: Mapping[str, ParameterSpec]) -> None:
    """A child's parent is declared before it, has values, and takes its parent_values."""
    where = f"Parameter {shown(param.name)}"
    if param.parent is None:
        if param.parent_values is not None:
            raise InvalidTuningSpecError(
                f"{where} has parent_values but no parent.",
                "Name the parent parameter, or leave parent_values out.",
            )
        return
    if param.parent == param.name:
        raise InvalidTuningSpecError(
            f"{where} names itself as its parent.", "Name another parameter, declared above it."
        )
    parent = seen.get(param.parent)
    if parent is None:
        raise InvalidTuningSpecError(
            f"{where} names the parent {shown(param.parent)}, which is not a parameter declared "
            "before it.",
            "Declare the parent in parameters, above its children.",
        )
    if parent.type == "double":
        raise InvalidTuningSpecError(
            f"{where} names the double parameter {shown(param.parent)} as its parent: a double has "
            "no values to switch a child on.",
            f"Make {param.parent} integer, categorical or discrete.",
        )
    if not param.parent_values:
        raise InvalidTuningSpecError(
            f"{where} has a parent but no parent_values.",
            f"List the values of {param.parent} under which {param.name} is tuned.",
        )
    allowed = parent.grid_values()
    if parent.scale == "reverse_log" and parent.type == "integer":
        allowed = [parent.training_value(v) for v in allowed]
    wrong = [v for v in param.parent_values if v not in allowed]
    if wrong:
        raise InvalidTuningSpecError(
            f"{where}: parent_values {shown(wrong)} are not values of {shown(param.parent)}.",
            f"{param.parent} takes: {allowed[:20]}{' ...' if len(allowed) > 20 else ''}.",
        )
