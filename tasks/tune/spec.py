"""The tuning spec: what to tune over which ranges, which metric to optimise, how many trials.

The shape of Vertex AI's StudySpec, flattened so a YAML file and the Prefect form read alike:

- ``parameters``: one entry per parameter to tune: any field of ``train`` (TrainParams) but
  ``nodes``, the ``architecture``, or a network option (``pretrained``; ``memory_efficient`` for
  DenseNets, ``zero_init_residual`` for ResNets). Each is checked against its field: an int
  field takes ``integer``, ``discrete`` or ``categorical`` ints, a float ``double``, ``discrete``
  or ``categorical``, a bool or a choice (``device``, ``precision``) ``categorical`` values it
  allows; every bound and value must be one the field accepts. Of type ``double`` or ``integer``
  (``min``, ``max``, ``scale``: linear, log or reverse_log), ``categorical`` (``values``) or
  ``discrete`` (increasing numeric ``values``, ``scale``). A conditional child names its
  ``parent`` (an integer, categorical or discrete parameter declared before it) and the
  ``parent_values`` under which it is tuned; otherwise it keeps its value from ``train``.
- ``metric`` (any per-epoch metric of the training run, tasks.train.loop.EPOCH_METRICS, e.g.
  ``val/top1``) and ``goal``;
  ``measurement``: a trial's value is its ``best`` epoch's metric or its ``last``.
- ``max_trial_count``, ``parallel_trial_count``, ``max_failed_trial_count`` (0: no trial may
  fail; Vertex AI's 0 lets the service decide, ours does not guess); ``algorithm``:
  ``bayesian`` (default), ``random`` or ``grid``; ``early_stopping`` of poor trials.
- ``train``: the training parameters every trial starts from; ``model``: the architecture (a
  tuned ``architecture`` overrides it).

Structure (types, bounds) is checked when the model is built; :meth:`TuningSpec.check` refuses,
before any trial runs, what cannot make a study, with InvalidTuningSpecError saying why.

Scales: ``log`` samples uniformly in log space; ``reverse_log`` samples more densely near
``max`` (for values like momentum 0.9 to 0.999): the value is ``min + max - m`` where ``m`` is
log-uniform on [min, max]. Optuna holds ``m`` (so the sampler models a log-uniform variable);
:meth:`TuningSpec.training_values` turns it back into the value trained with.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from models.untrained import FAMILIES, Family, ModelChoice, architectures
from tasks.errors import InvalidParameterError, InvalidTuningSpecError
from tasks.train.loop import EPOCH_METRICS, TOP1
from tasks.train.params import TrainParams
from tasks.validation import describe, expected

# bool first: pydantic's smart union keeps True a bool (int would take it too).
Value = bool | int | float | str
ARCHITECTURE = "architecture"
# The network's options (TuningSpec fields, for build_model), each for the family that has it.
MODEL_OPTIONS = ("pretrained", "memory_efficient", "zero_init_residual")
# Each family's own switch, and the family that has it.
FAMILY_OPTIONS = {f.switch: f for f in FAMILIES.values() if f.switch}
# Training parameters no trial can vary, and why.
FIXED = {
    "nodes": "a trial trains on one node (torchrun --standalone); several trials use several "
    "machines",
}


def tunable() -> tuple[str, ...]:
    """What a study may tune: TrainParams' fields but FIXED, the architecture, network options.

    Read from TrainParams when asked, so a field added there is tunable; each parameter spec is
    checked against its field's type and range (:func:`_check_parameter`).
    """
    fields = (name for name in TrainParams.model_fields if name not in FIXED)
    return (*fields, ARCHITECTURE, *MODEL_OPTIONS)


TUNABLE = tunable()
# What a training run reports after every epoch (tasks.train.loop): any of it may be the metric.
METRICS = EPOCH_METRICS
MAX_GRID = 10_000
MAX_PARALLEL_TRIALS = 64  # the tune flow's thread pool: one thread waits on each running trial
STUDY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class ParameterSpec(BaseModel):
    """One tuned training parameter: its type, range or values, and its parent if conditional."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        title="Training parameter",
        description="Any training parameter but nodes, the architecture, or a network option: "
        f"{', '.join(TUNABLE)}.",
    )
    type: Literal["double", "integer", "categorical", "discrete"] = Field(
        title="Type",
        description="double / integer: a range (min, max, scale); categorical: a set of values; "
        "discrete: increasing numbers.",
    )
    min: float | None = Field(None, title="Minimum", description="double and integer only.")
    max: float | None = Field(None, title="Maximum", description="double and integer only.")
    scale: Literal["linear", "log", "reverse_log"] = Field(
        "linear",
        title="Scale",
        description="How values are sampled: linear; log (uniform in log space, min > 0); "
        "reverse_log (denser near max, min > 0).",
    )
    values: list[Value] | None = Field(
        None, title="Values", description="categorical and discrete only."
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

    def training_value(self, internal: Any) -> Value:
        """The value trained with, from the value Optuna holds (see the module's reverse_log)."""
        if self.type in ("double", "integer") and self.scale == "reverse_log":
            assert self.min is not None and self.max is not None
            # Clamped: float rounding must not step past a bound (momentum < 1).
            internal = min(max(self.min + self.max - internal, self.min), self.max)
        if self.type == "integer":
            return round(internal)
        return internal

    def grid_values(self) -> list[Value]:
        """Every value a grid visits (in Optuna's terms); a double has no grid."""
        if self.type == "integer":
            assert self.min is not None and self.max is not None
            return list(range(int(self.min), int(self.max) + 1))
        if self.type in ("categorical", "discrete"):
            return list(self.values or [])
        raise InvalidTuningSpecError(
            f"Parameter {self.name!r} is a double: it has no grid.",
            "Use algorithm bayesian or random, or make it discrete (a list of values).",
        )


def _default_parameters() -> list[ParameterSpec]:
    return [
        ParameterSpec(name="learning_rate", type="double", min=1e-4, max=0.1, scale="log"),
        ParameterSpec(name="batch_size", type="discrete", values=[8, 16, 32]),
    ]


class TuningSpec(BaseModel):
    """A hyperparameter tuning study: the form the tune flow takes, the shape of tuning.yaml."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    study_name: str | None = Field(
        None,
        title="Study name",
        description="Starting again with the same name continues the study where it stopped. "
        "Empty: a new study named tune-<UTC time>.",
    )
    metric: str = Field(
        TOP1,
        title="Metric",
        description=f"Per-epoch metric of the training run: {', '.join(METRICS)}.",
    )
    goal: Literal["maximize", "minimize"] = Field("maximize", title="Goal")
    parameters: list[ParameterSpec] = Field(
        default_factory=_default_parameters,
        min_length=1,
        title="Parameters",
        description="The training parameters to tune and their ranges or values.",
    )
    max_trial_count: int = Field(
        10, gt=0, title="Max trials", description="Trials to run in all (a grid: at most its size)."
    )
    parallel_trial_count: int = Field(
        1,
        gt=0,
        le=MAX_PARALLEL_TRIALS,
        title="Parallel trials",
        description="Trials running at once. More finish sooner, but the Bayesian search learns "
        "from fewer finished trials when it picks the next.",
    )
    max_failed_trial_count: int = Field(
        0,
        ge=0,
        title="Max failed trials",
        description="How many trials may fail (e.g. diverge) before the study fails. 0 (the "
        "default): none may, the first failed trial fails the study (unlike Vertex AI, where 0 "
        "leaves the count to the service). Interrupted trials do not count.",
    )
    algorithm: Literal["bayesian", "random", "grid"] = Field(
        "bayesian",
        title="Search algorithm",
        description="bayesian: Optuna's TPE (learns from finished trials); random; grid: every "
        "combination of integer, categorical and discrete values.",
    )
    measurement: Literal["best", "last"] = Field(
        "best",
        title="Measurement",
        description="A trial's value: its best epoch's metric (the model kept is a best epoch), "
        "or its last epoch's.",
    )
    early_stopping: bool = Field(
        False,
        title="Early stopping",
        description="Stop (prune) a trial whose metric after an epoch is worse than the median "
        "of the completed trials at the same epoch.",
    )
    early_stopping_min_trials: int = Field(
        5, ge=1, title="Early stopping: completed trials first", description="Before pruning."
    )
    early_stopping_min_epochs: int = Field(
        1, ge=1, title="Early stopping: first epoch judged", description="No pruning before."
    )
    seed: int = Field(1, title="Search seed", description="Seeds the random and Bayesian search.")
    model: str = Field(
        "resnet18",
        title="Architecture",
        description="Each trial's network, unless architecture is tuned: densenet121/161/169/201, "
        "resnet18/34/50/101/152, resnext50_32x4d, resnext101_32x8d, wide_resnet50_2, "
        "wide_resnet101_2.",
    )
    pretrained: bool = Field(False, title="Pretrained", description="Start from ImageNet weights.")
    memory_efficient: bool = Field(
        False,
        title="Memory-efficient DenseNet",
        description="DenseNets only: recompute the concatenations in the backward pass (less "
        "memory, slower).",
    )
    zero_init_residual: bool = Field(
        False,
        title="Zero-init residual (ResNet)",
        description="ResNets only: start each residual branch's last BatchNorm at zero.",
    )
    train: TrainParams = Field(
        default_factory=TrainParams,
        title="Training parameters",
        description="What every trial trains with; the tuned parameters replace their values.",
    )

    @classmethod
    def checked(cls, **values: Any) -> TuningSpec:
        """Build and :meth:`check` a spec; anything wrong raises InvalidTuningSpecError."""
        try:
            spec = cls(**values)
        except ValidationError as exc:
            message, hint = describe(cls, exc)
            raise InvalidTuningSpecError(f"Invalid tuning spec: {message}.", hint) from exc
        return spec.check()

    @classmethod
    def from_yaml(cls, path: Path) -> TuningSpec:
        """Read a tuning.yaml-shaped file (1e-4 reads as a number); checked in full."""
        try:
            data = yaml.load(Path(path).read_text(), Loader=_Loader) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise InvalidTuningSpecError(
                f"Cannot read {path}: {exc}.",
                "Check the path, and that the file is plain YAML in the shape of tuning.yaml "
                "(no !!python tags).",
            ) from exc
        if not isinstance(data, dict):
            raise InvalidTuningSpecError(
                f"{path} is not a mapping of spec fields.",
                "Start from tuning.yaml: study_name, metric, parameters, ... at the top level.",
            )
        try:
            return cls.checked(**data)
        except InvalidTuningSpecError as exc:
            raise InvalidTuningSpecError(f"{path}: {exc.message}", exc.hint) from exc

    def check(self) -> TuningSpec:
        """Refuse what cannot make a study; returns the spec. Raises InvalidTuningSpecError."""
        if self.study_name is not None and not STUDY_NAME.match(self.study_name):
            raise InvalidTuningSpecError(
                f"study_name = {self.study_name!r} is not a usable study name.",
                "Use letters, digits, '_', '.' and '-' (up to 128, starting with a letter or "
                "digit): it names the study's journal file and folder.",
            )
        if self.metric not in METRICS:
            raise InvalidTuningSpecError(
                f"metric = {self.metric!r} is not a metric the training run reports.",
                f"Use one of: {', '.join(METRICS)}.",
            )
        _check_model_name(self.model, "model")
        if self.train.nodes > 1:
            raise InvalidTuningSpecError(
                f"train.nodes = {self.train.nodes}: a trial trains on one node.",
                "Give each trial nproc_per_node processes on one machine, and run trials in "
                "parallel (parallel_trial_count, on the work pool) to use more machines.",
            )
        seen: dict[str, ParameterSpec] = {}
        for param in self.parameters:
            if param.name in seen:
                raise InvalidTuningSpecError(
                    f"Parameter {param.name!r} is tuned twice.",
                    "Name each training parameter once; use a categorical or discrete parent "
                    "for values that depend on another parameter.",
                )
            _check_parameter(param)
            _check_parent(param, seen)
            seen[param.name] = param
        self._check_model_options()
        if self.algorithm == "grid":
            doubles = [p.name for p in self.parameters if p.type == "double"]
            if doubles:
                raise InvalidTuningSpecError(
                    f"A grid search cannot enumerate the double parameter {doubles[0]!r}: it has "
                    "infinitely many values.",
                    f"Make {doubles[0]} discrete (type: discrete, values: [...]), or use "
                    "algorithm random or bayesian.",
                )
            size = self.grid_size()
            if size > self.max_trial_count:
                raise InvalidTuningSpecError(
                    f"The grid has {size} points, more than max_trial_count = "
                    f"{self.max_trial_count}: part of a grid is a biased search.",
                    f"Raise max_trial_count to {size}, shrink the grid, or use algorithm random "
                    "or bayesian.",
                )
        return self

    def _check_model_options(self) -> None:
        """A network option is on only for architectures of the family that has it."""
        tuned = self.by_name()
        for option, family in FAMILY_OPTIONS.items():
            param = tuned.get(option)
            # The spec's own value holds wherever the option is not tuned.
            if getattr(self, option) and (param is None or param.parent is not None):
                _check_family(
                    option, self.architectures(None), family, f"{option} = true", tuned=False
                )
            if param is not None and True in (param.values or []):
                where = f"Parameter {option!r} (true among its values)"
                _check_family(option, self.architectures(param), family, where, tuned=True)

    def architectures(self, param: ParameterSpec | None) -> list[str]:
        """The architectures a trial may train while ``param`` is tuned (None: in any trial)."""
        if param is not None and param.parent == ARCHITECTURE:
            return [str(v) for v in param.parent_values or []]
        arch = self.by_name().get(ARCHITECTURE)
        if arch is None:
            return [self.model]
        values = [str(v) for v in arch.values or []]
        return values if arch.parent is None else [*values, self.model]

    def by_name(self) -> dict[str, ParameterSpec]:
        return {p.name: p for p in self.parameters}

    def is_active(self, param: ParameterSpec, chosen: Mapping[str, Any]) -> bool:
        """Whether ``param`` is tuned given the values chosen so far (Optuna's internal ones)."""
        if param.parent is None:
            return True
        if param.parent not in chosen:
            return False
        parent = self.by_name()[param.parent]
        return parent.training_value(chosen[param.parent]) in (param.parent_values or [])

    def training_values(self, internal: Mapping[str, Any]) -> dict[str, Value]:
        """The values a trial trains with, from the parameters Optuna holds for it."""
        specs = self.by_name()
        return {
            name: specs[name].training_value(v) for name, v in internal.items() if name in specs
        }

    def grid(self) -> list[dict[str, Value]]:
        """Every point of the grid (Optuna's values), children only under their parents' values.

        Declared order; a child's values multiply only the points where it is switched on, so
        no two points train the same configuration.
        """
        return list(self._grid_points(MAX_GRID + 1))

    def grid_size(self) -> int:
        size = sum(1 for _ in self._grid_points(MAX_GRID + 1))
        if size > MAX_GRID:
            raise InvalidTuningSpecError(
                f"The grid has more than {MAX_GRID} points.",
                "Shrink the integer ranges or the value lists, or use algorithm random or "
                "bayesian.",
            )
        return size

    def _grid_points(self, limit: int) -> Iterator[dict[str, Value]]:
        points: list[dict[str, Value]] = [{}]
        for param in self.parameters:
            grown: list[dict[str, Value]] = []
            for point in points:
                if self.is_active(param, point):
                    grown += [{**point, param.name: v} for v in param.grid_values()]
                else:
                    grown.append(point)
                if len(grown) >= limit:
                    break
            points = grown[:limit]
        yield from points

    def trial_params(self, values: Mapping[str, Value]) -> TrainParams:
        """``train`` with a trial's tuned values; refused like any training parameter."""
        tuned = {k: v for k, v in values.items() if k in TrainParams.model_fields}
        return TrainParams.checked(**{**self.train.model_dump(), **tuned})

    def trial_model(self, values: Mapping[str, Value]) -> ModelChoice:
        """The network of a trial: its architecture and options, tuned or the spec's."""
        options = {name: bool(values.get(name, getattr(self, name))) for name in MODEL_OPTIONS}
        return ModelChoice(name=str(values.get(ARCHITECTURE, self.model)), **options)

    def identity(self) -> dict[str, Any]:
        """What makes trials comparable: a study continues only with the same.

        The counts, the algorithm, early stopping and the seed may change between runs of a
        study; the search space, the metric and what each trial trains may not.
        """
        identity = self.model_dump(
            mode="json",
            include={
                "metric",
                "goal",
                "measurement",
                "parameters",
                "model",
                "train",
                *MODEL_OPTIONS,
            },
        )
        # Options that came later count only when on: a study started before them continues.
        for option in FAMILY_OPTIONS:
            if not identity[option]:
                del identity[option]
        return identity


def identity_digest(identity: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def _check_model_name(name: object, where: str) -> None:
    if name not in architectures():
        raise InvalidTuningSpecError(
            f"{where}: {name!r} is not an architecture of the zoo.",
            f"Choose from: {', '.join(architectures())}.",
        )


def _field(name: str) -> FieldInfo:
    """The field a tuned parameter sets: a training parameter, or the spec's own (model options)."""
    return TrainParams.model_fields.get(name) or TuningSpec.model_fields[name]


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
        return "one of " + ", ".join(architectures())
    return expected(_field(name))


def _check_parameter(param: ParameterSpec) -> None:
    """The parameter against its field: a type that fits, values and bounds within its range."""
    name, kind = param.name, param.type
    where = f"Parameter {name!r}"
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
    ranged = kind in ("double", "integer")
    if ranged and (param.min is None or param.max is None or param.values is not None):
        raise InvalidTuningSpecError(
            f"{where} ({kind}) needs min and max, and no values.",
            "Give min and max; use type categorical or discrete for a list of values.",
        )
    if not ranged and (not param.values or param.min is not None or param.max is not None):
        raise InvalidTuningSpecError(
            f"{where} ({kind}) needs a non-empty list of values, and no min or max.",
            "Give values: [...]; use type double or integer for a range.",
        )
    if kind == "categorical" and param.scale != "linear":
        raise InvalidTuningSpecError(
            f"{where} is categorical: its values have no scale.",
            "Leave scale out, or make it discrete (increasing numbers) to give one.",
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
    if ranged:
        assert param.min is not None and param.max is not None
        if kind == "integer" and not (param.min.is_integer() and param.max.is_integer()):
            raise InvalidTuningSpecError(
                f"{where} is an integer range: min = {param.min:g} and max = {param.max:g} must "
                "be whole numbers.",
                "Round min and max, or make the parameter a double.",
            )
        if param.min >= param.max:
            raise InvalidTuningSpecError(
                f"{where}: min = {param.min:g} must be below max = {param.max:g}.",
                "Swap min and max, or make the range wider.",
            )
        candidates: list[tuple[str, Value]] = [("min", param.min), ("max", param.max)]
    else:
        values = list(param.values or [])
        _check_distinct(param, values)
        words = [v for v in values if isinstance(v, str | bool)]
        if words:
            raise InvalidTuningSpecError(
                f"{where} takes numbers; got {words}.",
                "Write numbers without quotes (1e-4 and 0.0001 both read as numbers).",
            )
        candidates = [("value", v) for v in values]
    numbers = [float(v) for _, v in candidates]
    if kind == "discrete" and any(b <= a for a, b in itertools.pairwise(numbers)):
        raise InvalidTuningSpecError(
            f"{where} is discrete: its values must increase; got {param.values}.",
            "Sort the values and drop duplicates.",
        )
    if param.scale != "linear" and min(numbers) <= 0:
        raise InvalidTuningSpecError(
            f"{where} has a {param.scale} scale, which needs values > 0; its minimum is "
            f"{min(numbers):g}.",
            "Raise min above 0, or use scale linear.",
        )
    for label, value in candidates:
        if field_kind == "int" and isinstance(value, float) and value.is_integer():
            value = int(value)
        _check_in_range(name, label, value)


def _check_choices(param: ParameterSpec, field_kind: str) -> None:
    """A bool, Literal or other non-numeric parameter: categorical, each value one it takes."""
    name, where = param.name, f"Parameter {param.name!r}"
    if param.type != "categorical":
        raise InvalidTuningSpecError(
            f"{where} takes {_allowed(name)}: it must be categorical.",
            f"type: categorical, values: [...] ({_allowed(name)}).",
        )
    values = list(param.values or [])
    _check_distinct(param, values)
    for value in values:
        if name == ARCHITECTURE:
            _check_model_name(value, where)
        elif field_kind == "bool" and not isinstance(value, bool):
            raise InvalidTuningSpecError(
                f"{where} is true or false; got {value!r}.",
                "values: [true, false], without quotes.",
            )
        elif name in TrainParams.model_fields:
            _check_in_range(name, "value", value)


def _check_distinct(param: ParameterSpec, values: list[Value]) -> None:
    if len({(type(v), v) for v in values}) != len(values):
        raise InvalidTuningSpecError(
            f"Parameter {param.name!r} lists a value twice: {values}.", "List each value once."
        )


def _check_in_range(name: str, label: str, value: Value) -> None:
    """``value`` is one the training takes for ``name`` (validated by TrainParams itself)."""
    try:
        TrainParams.checked(**{name: value})
    except InvalidParameterError as exc:
        raise InvalidTuningSpecError(
            f"Parameter {name!r}: {label} = {value!r} is out of range; {name} takes "
            f"{_allowed(name)}.",
            exc.hint,
        ) from exc


def _check_family(option: str, trained: list[str], family: Family, where: str, tuned: bool) -> None:
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


def _check_parent(param: ParameterSpec, seen: Mapping[str, ParameterSpec]) -> None:
    where = f"Parameter {param.name!r}"
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
            f"{where} names the parent {param.parent!r}, which is not a parameter declared "
            "before it.",
            "Declare the parent in parameters, above its children.",
        )
    if parent.type == "double":
        raise InvalidTuningSpecError(
            f"{where} names the double parameter {param.parent!r} as its parent: a double has "
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
            f"{where}: parent_values {wrong} are not values of {param.parent!r}.",
            f"{param.parent} takes: {allowed[:20]}{' ...' if len(allowed) > 20 else ''}.",
        )


class _Loader(yaml.SafeLoader):
    """YAML 1.2 floats: PyYAML alone reads ``1e-4`` (no dot) as a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)
