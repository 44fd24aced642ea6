"""The tuning spec: what to tune over which ranges, which metric to optimise, how many trials.

The shape of Vertex AI's StudySpec, flattened so a YAML file and the Prefect form read alike:
``parameters``, ``metric``/``goal``/``measurement``, the trial counts, ``algorithm``,
``early_stopping``, ``train`` and ``model``. Structure is checked when the model is built;
:meth:`TuningSpec.check` refuses what cannot make a study, before any trial, with
InvalidTuningSpecError. Details: docs/tuning.md#the-spec (and #scales for ``reverse_log``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import to_jsonable_python

from models.bounded_parse import BoundedLoader, read_yaml
from models.form_sections import flattened, schema_extra
from models.untrained import ModelChoice
from tasks.shared.errors import InvalidTuningSpecError
from tasks.shared.validation import describe
from tasks.train.loop import TOP1
from tasks.train.params import TrainParams
from tasks.tune.parameters import REFUSED, ParameterSpec, Value, default_parameters
from tasks.tune.spec_checks import METRICS, check_spec
from tasks.tune.tunable import ARCHITECTURE, FAMILY_OPTIONS, MODEL_OPTIONS, train_with
from tasks.tune.tunable import tunable as tunable  # where tests and callers have found it

MAX_GRID = 10_000
MAX_PARALLEL_TRIALS = 64  # the tune flow's thread pool: one thread waits on each running trial


class TuningSpec(BaseModel):
    """A hyperparameter tuning study: the form the tune flow takes, the shape of tuning.yaml."""

    # The tune form's spec is optional (empty: the example study): a picker of saved studies.
    model_config = ConfigDict(
        extra="forbid", frozen=True, json_schema_extra=schema_extra((), saved_as="imageops-study")
    )

    @model_validator(mode="before")
    @classmethod
    def _from_a_saved_study(cls, data: Any) -> Any:
        return flattened(data, ())

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
    goal: Literal["maximize", "minimize"] = Field(
        "maximize",
        title="Goal",
        description="Whether the metric's best value is its largest (maximize) or smallest.",
    )
    parameters: list[ParameterSpec] = Field(
        default_factory=default_parameters,
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
            errors = exc.errors()
            if all(err["type"] == REFUSED for err in errors):  # a parameter's shape, and why
                ctx = errors[0].get("ctx") or {}
                raise InvalidTuningSpecError(ctx["message"], ctx["hint"]) from exc
            message, hint = describe(cls, exc)
            raise InvalidTuningSpecError(f"Invalid tuning spec: {message}.", hint) from exc
        return spec.check()

    @classmethod
    def from_yaml(cls, path: Path) -> TuningSpec:
        """Read a tuning.yaml-shaped file (1e-4 reads as a number); checked in full."""
        hint = (
            "Check the path, and that the file is plain YAML in the shape of tuning.yaml "
            "(no !!python tags)."
        )
        data = read_yaml(path, InvalidTuningSpecError, hint, _Loader) or {}
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
        check_spec(self)
        return self

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
        return train_with(self.train, values)

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
                "model",
                "train",
                *MODEL_OPTIONS,
            },
        )
        # Every parameter with every field, as when one model held all types.
        identity["parameters"] = [to_jsonable_python(p.record()) for p in self.parameters]
        # Options that came later count only when on: a study started before them continues.
        for option in FAMILY_OPTIONS:
            if not identity[option]:
                del identity[option]
        return identity


def identity_digest(identity: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


class _Loader(BoundedLoader):
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
