"""Continuing a study: the same setup only, one flow at a time, interrupted trials again.

A study continues only with the identity it was started with (the search space, metric,
training setup and data); one tune flow owns it at a time, so trials still RUNNING when a flow
starts were left by a killed flow: they are failed as interrupted and their parameters queued
again. A grid queues every point no trial has taken.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import optuna
import psutil
from optuna.storages import BaseStorage
from optuna.trial import TrialState

from tasks.shared.errors import InvalidParameterError, InvalidTuningSpecError
from tasks.shared.step import step_logger
from tasks.tune.records import (
    ERROR,
    IDENTITY,
    IDENTITY_DIGEST,
    INTERRUPTED,
    OWNER,
    RESUMES,
    interrupted,
)
from tasks.tune.spec import TuningSpec, identity_digest


def check_identity(study: optuna.Study, name: str, identity: dict[str, Any]) -> None:
    digest = identity_digest(identity)
    stored = study.user_attrs.get(IDENTITY_DIGEST)
    if stored is None:
        study.set_user_attr(IDENTITY, json.dumps(identity, sort_keys=True))
        study.set_user_attr(IDENTITY_DIGEST, digest)
        return
    if stored == digest:
        return
    before = json.loads(study.user_attrs.get(IDENTITY, "{}"))
    changed = sorted(k for k in identity.keys() | before.keys() if identity.get(k) != before.get(k))
    raise InvalidTuningSpecError(
        f"Study {name!r} was started with another setup (differs in: {', '.join(changed)}); its "
        "trials would not be comparable with new ones.",
        "Continue it with the spec and data it was started with (only the counts, the "
        "algorithm, early stopping and the seed may change), or use another study_name.",
    )


def _me() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": psutil.Process().create_time(),
    }


def _alive(owner: dict[str, Any]) -> bool:
    """Whether the process that owned the study still runs (only knowable on this host)."""
    if owner.get("host") != socket.gethostname():
        return False
    try:
        return abs(psutil.Process(int(owner["pid"])).create_time() - owner["started"]) < 1.0
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def take_ownership(study: optuna.Study, name: str) -> None:
    """One flow tunes a study at a time: its RUNNING trials are then all that flow's."""
    me, owner = _me(), study.user_attrs.get(OWNER)
    if owner and owner.get("pid") != me["pid"] and _alive(owner):
        raise InvalidParameterError(
            f"Study {name!r} is being tuned right now by process {owner['pid']} on this machine.",
            "Wait for that flow to end (or stop it), or tune under another study_name.",
        )
    if owner and owner.get("host") != me["host"]:
        step_logger(__name__).warning(
            "study %s was last tuned on %s; taking it over (its running trials count as "
            "interrupted)",
            name,
            owner.get("host"),
        )
    study.set_user_attr(OWNER, me)


def recover_interrupted(study: optuna.Study, storage: BaseStorage) -> list[int]:
    """Mark trials left RUNNING as interrupted FAILs and queue their parameters again."""
    study_id = storage.get_study_id_from_name(study.study_name)
    recovered = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        storage.set_trial_user_attr(trial_id, INTERRUPTED, True)
        storage.set_trial_user_attr(trial_id, ERROR, "interrupted: its flow stopped")
        study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
        if trial.params:
            resumes = trial.user_attrs.get(RESUMES, trial.number)
            study.enqueue_trial(dict(trial.params), user_attrs={RESUMES: resumes})
        recovered.append(trial.number)
    return recovered


def queue_grid(study: optuna.Study, spec: TuningSpec) -> None:
    """Queue every grid point no trial has taken (finished, running or queued)."""
    taken = []
    for trial in study.get_trials(deepcopy=False):
        if trial.state == TrialState.WAITING:
            taken.append(trial.system_attrs.get("fixed_params", {}))
        elif not interrupted(trial):
            taken.append(trial.params)
    for point in spec.grid():
        if point not in taken:
            study.enqueue_trial(point)
