"""The spec in Optuna's terms: the sampler of each algorithm, the pruner, one trial's parameters.

bayesian: multivariate TPE with ``constant_liar``; random: independent draws; grid: each point
enqueued as a fixed trial (Optuna's GridSampler would repeat configurations with conditional
children). Samplers are seeded from the spec's seed and the trials already run, so a continued study
draws new points. Details: docs/tuning.md#search.
"""

from __future__ import annotations

import warnings
from typing import Any

import optuna
from optuna.pruners import BasePruner, MedianPruner, NopPruner
from optuna.samplers import BaseSampler, RandomSampler, TPESampler

from tasks.train.loop import derive_seed
from tasks.tune.spec import TuningSpec


def make_sampler(spec: TuningSpec, trials_so_far: int) -> BaseSampler:
    seed = derive_seed(spec.seed, "tune", trials_so_far) % 2**32
    if spec.algorithm == "bayesian":
        with warnings.catch_warnings():  # multivariate and group are "experimental" in Optuna
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True)
    return RandomSampler(seed=seed)


def make_pruner(early_stopping: bool, min_trials: int, min_epochs: int) -> BasePruner:
    """The median rule: prune a trial worse than the median of completed trials at that epoch.

    ``min_trials`` completed trials are needed first; epochs before ``min_epochs`` are never
    judged. Off: nothing is pruned (the epochs are still reported, for the record).
    """
    if not early_stopping:
        return NopPruner()
    return MedianPruner(n_startup_trials=min_trials, n_warmup_steps=min_epochs, interval_steps=1)


def suggest(trial: optuna.Trial, spec: TuningSpec) -> dict[str, Any]:
    """Draw the trial's parameters in declared order, a child only when its parent allows it.

    Returns Optuna's values (see :meth:`TuningSpec.training_values` for the trained ones).
    """
    chosen: dict[str, Any] = {}
    for param in spec.parameters:
        if not spec.is_active(param, chosen):
            continue
        log = param.scale != "linear"
        if param.type == "double":
            assert param.min is not None and param.max is not None
            value: Any = trial.suggest_float(param.name, param.min, param.max, log=log)
        elif param.type == "integer":
            assert param.min is not None and param.max is not None
            value = trial.suggest_int(param.name, int(param.min), int(param.max), log=log)
        else:  # categorical, discrete: the listed values (a discrete scale only bounds them)
            value = trial.suggest_categorical(param.name, list(param.values or []))
        chosen[param.name] = value
    return chosen
