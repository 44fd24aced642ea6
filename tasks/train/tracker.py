"""A training run's MLflow records, written so that an outage of the tracking server loses none.

Rank 0 logs each epoch's metrics but never waits long on MLflow: a record the server does not take
is given up after a short budget (:data:`RANK0_MLFLOW_HTTP`) and backfilled later, once. Imported by
rank 0 and the launcher only. Details: docs/training.md#records-during-training.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import requests
from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException

from tasks.shared.tracking import logged_value

# What a client call raises when the tracking store does not take a record: MLflow's own error
# (its retries exhausted, a 5xx, a locked SQLite file), a failed artifact upload, a full disk.
TRACKING_ERRORS = (MlflowException, requests.RequestException, OSError)

# Rank 0's MLflow client budget (MLflow's variables, set in rank 0's process only): a record is
# given up after about 3 s of refused connections (2 retries, 0 and 2 s apart) or 3 x 30 s when the
# server hangs. The other ranks wait for rank 0 at the next collective for at most
# tasks.train.distributed.COLLECTIVE_TIMEOUT (5 minutes); MLflow's defaults (7 retries over about
# 4 minutes, 120 s a request) could outlast that and take the whole job down with the server.
RANK0_MLFLOW_HTTP = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}

log = logging.getLogger("imageops.train")


def transient(exc: BaseException) -> bool:
    """True when trying the same call again later may succeed (server down, busy, failing)."""
    if isinstance(exc, MlflowException):
        status = exc.get_http_status_code()
        return status >= 500 or status == 429
    return isinstance(exc, TRACKING_ERRORS)


def log_missing(
    client: MlflowClient, run_id: str, history: Sequence[dict[str, float]]
) -> list[int]:
    """Log the epochs of ``history`` whose metrics the run lacks; returns the steps written.

    Each entry is ``{"epoch": n, name: value, ...}``; a metric already logged at that step is
    skipped, so calling this again after a partial write, or after a kill between the checkpoint
    and the metrics, logs every epoch exactly once. Raises at the first call that fails.
    """
    logged: dict[str, set[int]] = {}
    written = []
    for entry in history:
        step = int(entry["epoch"])
        missing = {}
        for name, value in entry.items():
            if name == "epoch":
                continue
            if name not in logged:
                logged[name] = {m.step for m in client.get_metric_history(run_id, name)}
            if step not in logged[name]:
                missing[name] = value
        if missing:
            _log(client, run_id, missing, step)
            written.append(step)
    return written


def _log(client: MlflowClient, run_id: str, metrics: dict[str, float], step: int) -> None:
    now = int(time.time() * 1000)
    records = [
        Metric(k, logged_value(float(v)), now, step) for k, v in metrics.items() if k != "epoch"
    ]
    client.log_batch(run_id, metrics=records)


class Tracker:
    """Rank 0's MLflow writer, on the run the launcher created (never a run of its own).

    A client call per record rather than ``mlflow.start_run``: the launcher owns the run's
    status, and an active-run context here would mark it FINISHED before the logs are attached.
    """

    def __init__(self, run_id: str | None, *, behind: bool = False) -> None:
        """``behind``: the run may lack earlier epochs (a resumed run), so the next record
        backfills them."""
        self.run_id = run_id
        self.behind = behind
        if run_id:
            os.environ.update(RANK0_MLFLOW_HTTP)  # read by the client at every request
            self.client = MlflowClient()  # MLFLOW_TRACKING_URI comes from the launcher

    def record(self, history: Sequence[dict[str, float]]) -> None:
        """Log the last epoch of ``history``, and every earlier one the run lacks; never raises.

        When MLflow does not take it, the training goes on: a warning, and the next call (or the
        launcher, at the end) writes what is missing.
        """
        if not self.run_id or not history:
            return
        last = history[-1]
        try:
            if self.behind:
                log_missing(self.client, self.run_id, history)
            else:
                _log(self.client, self.run_id, last, int(last["epoch"]))
            self.behind = False
        except TRACKING_ERRORS as exc:
            self.behind = True
            log.warning(
                "MLflow did not take the metrics of epoch %d; training goes on, and they will be "
                "written once MLflow answers: %s",
                int(last["epoch"]),
                exc,
            )
