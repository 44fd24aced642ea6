"""What cannot make a study, refused before any trial runs (:meth:`TuningSpec.check`).

Each parameter's own shape is checked when it is built (:mod:`tasks.tune.parameters`); here is
what needs the whole spec: the study name and metric, one node per trial, each parameter once
and against its field, parents declared first, network options only for their family, and a
grid that is finite and fits the trial count.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from models.bounded_parse import shown
from tasks.shared.errors import InvalidTuningSpecError
from tasks.train.loop import EPOCH_METRICS
from tasks.tune.parameters import ParameterSpec, check_parent
from tasks.tune.tunable import FAMILY_OPTIONS, check_family, check_model_name, check_parameter

if TYPE_CHECKING:
    from tasks.tune.spec import TuningSpec

# What a training run reports after every epoch (tasks.train.loop): any of it may be the metric.
METRICS = EPOCH_METRICS
STUDY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_spec(spec: TuningSpec) -> None:
    """Refuse what cannot make a study. Raises InvalidTuningSpecError saying why."""
    if spec.study_name is not None and not STUDY_NAME.match(spec.study_name):
        raise InvalidTuningSpecError(
            f"study_name = {shown(spec.study_name)} is not a usable study name.",
            "Use letters, digits, '_', '.' and '-' (up to 128, starting with a letter or "
            "digit): it names the study's journal file and folder.",
        )
    if spec.metric not in METRICS:
        raise InvalidTuningSpecError(
            f"metric = {shown(spec.metric)} is not a metric the training run reports.",
            f"Use one of: {', '.join(METRICS)}.",
        )
    check_model_name(spec.model, "model")
    if spec.train.nodes > 1:
        raise InvalidTuningSpecError(
            f"train.nodes = {spec.train.nodes}: a trial trains on one node.",
            "Give each trial nproc_per_node processes on one machine, and run trials in "
            "parallel (parallel_trial_count, on the work pool) to use more machines.",
        )
    seen: dict[str, ParameterSpec] = {}
    for param in spec.parameters:
        if param.name in seen:
            raise InvalidTuningSpecError(
                f"Parameter {shown(param.name)} is tuned twice.",
                "Name each training parameter once; use a categorical or discrete parent "
                "for values that depend on another parameter.",
            )
        check_parameter(param)
        check_parent(param, seen)
        seen[param.name] = param
    _check_model_options(spec)
    if spec.algorithm == "grid":
        _check_grid(spec)


def _check_model_options(spec: TuningSpec) -> None:
    """A network option is on only for architectures of the family that has it."""
    tuned = spec.by_name()
    for option, family in FAMILY_OPTIONS.items():
        param = tuned.get(option)
        # The spec's own value holds wherever the option is not tuned.
        if getattr(spec, option) and (param is None or param.parent is not None):
            check_family(option, spec.architectures(None), family, f"{option} = true", tuned=False)
        if param is not None and True in (param.values or []):
            where = f"Parameter {shown(option)} (true among its values)"
            check_family(option, spec.architectures(param), family, where, tuned=True)


def _check_grid(spec: TuningSpec) -> None:
    """A grid has no double, and no more points than trials (part of a grid is biased)."""
    doubles = [p.name for p in spec.parameters if p.type == "double"]
    if doubles:
        raise InvalidTuningSpecError(
            f"A grid search cannot enumerate the double parameter {shown(doubles[0])}: it has "
            "infinitely many values.",
            f"Make {doubles[0]} discrete (type: discrete, values: [...]), or use "
            "algorithm random or bayesian.",
        )
    size = spec.grid_size()
    if size > spec.max_trial_count:
        raise InvalidTuningSpecError(
            f"The grid has {size} points, more than max_trial_count = "
            f"{spec.max_trial_count}: part of a grid is a biased search.",
            f"Raise max_trial_count to {size}, shrink the grid, or use algorithm random "
            "or bayesian.",
        )
