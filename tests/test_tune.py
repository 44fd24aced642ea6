"""Tuning studies end to end on digits: real torchrun trials, Optuna journal files, MLflow, Prefect.

Tiny settings (16 px digits, 3 classes, 1-2 epochs, one process per trial) keep each trial at a
few seconds; the flows run under the session's real Prefect API.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from mlflow import MlflowClient
from optuna.trial import TrialState
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactCollectionFilter,
    ArtifactCollectionFilterKey,
    FlowRunFilter,
    FlowRunFilterName,
)
from server_processes import LONG_WAIT

from flows.tune import tune_flow
from models.directory import read_model_info
from models.transform_spec import TransformSpec
from tasks.shared import servers
from tasks.shared.errors import InvalidTuningSpecError, TuningFailedError
from tasks.shared.settings import Settings
from tasks.tune.gpus import local_gpus
from tasks.tune.spec import TuningSpec
from tasks.tune.storage import open_storage, storage_ref

ROOT = Path(__file__).resolve().parents[1]
PRE = TransformSpec(resize_size=16, center_crop_size=16, random_horizontal_flip=False)
# fp32: bf16 autocast on this CPU miscomputes resnet18's 1x1 maps at 16 px (see test_train_flow).
TRAIN = {
    "epochs": 1,
    "batch_size": 8,
    "learning_rate": 0.01,
    "device": "cpu",
    "precision": "fp32",
    "nproc_per_node": 1,
}


def make_spec(**fields: object) -> TuningSpec:
    return TuningSpec.checked(**{"train": TRAIN, **fields})


def tune(spec: TuningSpec, data: tuple[Path, Path], **options: object):
    return tune_flow(spec, str(data[0]), str(data[1]), transform=PRE, **options)


def trials_of(settings: Settings, name: str) -> list[optuna.trial.FrozenTrial]:
    storage = open_storage(storage_ref(settings, name), settings)
    return optuna.load_study(study_name=name, storage=storage).get_trials()


def overlapped(trials: list[optuna.trial.FrozenTrial]) -> int:
    """The most trials that ran at the same moment."""
    events = []
    for trial in trials:
        assert isinstance(trial.datetime_start, datetime) and trial.datetime_complete
        events += [(trial.datetime_start, 1), (trial.datetime_complete, -1)]
    most = now = 0
    for _, change in sorted(events, key=lambda e: (e[0], e[1])):
        now += change
        most = max(most, now)
    return most


def prefect_artifacts(*keys: str) -> dict[str, Any]:
    """The newest Prefect artifact of each key (what the UI's artifact page shows)."""
    with get_client(sync_client=True) as prefect:
        newest = prefect.read_latest_artifacts(
            artifact_filter=ArtifactCollectionFilter(
                key=ArtifactCollectionFilterKey(any_=list(keys))
            )
        )
    return {artifact.key: artifact for artifact in newest}


@pytest.mark.slow
def test_a_grid_runs_every_point_once_and_the_best_model_is_registered(
    prefect_api: None, project: Settings, digits_split: tuple[Path, Path]
) -> None:
    # 3 points: batch 8 with warm-up 0 or 1 (a child of batch size 8), and batch 100, which the
    # training refuses (72 training images): a failed trial, counted and tolerated (1 allowed).
    # print_frequency, once refused as "where a trial runs", is tuned like any training parameter.
    spec = make_spec(
        study_name="grid",
        algorithm="grid",
        max_trial_count=10,  # more than the grid: the grid's 3 points are the study
        parallel_trial_count=2,
        max_failed_trial_count=1,
        parameters=[
            {"name": "batch_size", "type": "discrete", "values": [8, 100]},
            {
                "name": "warmup_epochs",
                "type": "integer",
                "min": 0,
                "max": 1,
                "parent": "batch_size",
                "parent_values": [8],
            },
            {"name": "print_frequency", "type": "categorical", "values": [2]},
        ],
    )
    result = tune(spec, digits_split)

    trials = trials_of(project, "grid")
    assert sorted(json.dumps(t.params, sort_keys=True) for t in trials) == sorted(
        json.dumps(p, sort_keys=True)
        for p in [{"batch_size": 8, "warmup_epochs": 0, "print_frequency": 2},
                  {"batch_size": 8, "warmup_epochs": 1, "print_frequency": 2},
                  {"batch_size": 100, "print_frequency": 2}]
    )  # fmt: skip
    assert {t.state for t in trials if t.params["batch_size"] == 100} == {TrialState.FAIL}
    failed = next(t for t in result.trials if t.state == "FAIL")
    assert "batch_size = 100 is larger than the training set" in str(failed.error)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == 2
    assert overlapped(complete) == 2  # two at a time

    # The best trial's model is registered as @challenger, from its own (nested) training run.
    best = max(complete, key=lambda t: t.value)
    assert result.best is not None and result.best.number == best.number
    client = MlflowClient(project.tracking_uri, project.registry_uri)
    version = client.get_model_version_by_alias(project.registered_model_name, "challenger")
    assert int(version.version) == result.registered_version
    assert version.run_id == result.best.run_id
    assert result.best.model_dir is not None
    assert read_model_info(result.best.model_dir).mlflow_run_id == result.best.run_id

    # Each trial is a training run nested under the study's run, with its parameters and value.
    parent = client.get_run(result.parent_run_id)
    assert parent.info.run_name == "grid" and parent.info.status == "FINISHED"
    for trial in result.trials:
        if trial.state != "COMPLETE":
            continue
        run = client.get_run(trial.run_id)
        assert run.data.tags["mlflow.parentRunId"] == result.parent_run_id
        assert run.data.tags["imageops.trial"] == str(trial.number)
        assert run.data.params["warmup_epochs"] == str(trial.values["warmup_epochs"])
        assert run.data.params["print_frequency"] == "2"
        assert "imageops.gpus" not in run.data.tags  # a CPU trial takes no GPU
        assert run.data.metrics["tuning/value"] == pytest.approx(trial.value)
        assert [m.step for m in client.get_metric_history(trial.run_id, "val/top1")] == [1]
    logged = {Path(a.path).name for a in client.list_artifacts(result.parent_run_id, "tuning")}
    assert {"trials.csv", "trials.json", "trials.png"} <= logged
    assert parent.data.metrics["best_val_top1"] == pytest.approx(best.value)

    # The table and the plot in Prefect.
    artifacts = prefect_artifacts("tuning-trials", "tuning-report")
    table = json.loads(artifacts["tuning-trials"].data)
    assert sorted(row["number"] for row in table) == [0, 1, 2]
    assert {"state", "val/top1", "batch_size", "warmup_epochs", "duration_s"} <= set(table[0])
    assert "![metric over trials](data:image/png;base64," in artifacts["tuning-report"].data


@pytest.mark.slow
def test_failed_trials_past_the_limit_fail_the_study_naming_the_count(
    prefect_api: None, project: Settings, digits_split: tuple[Path, Path]
) -> None:
    # Batches larger than the training set: each trial fails at once, before torchrun starts.
    spec = make_spec(
        study_name="too-big",
        algorithm="grid",
        max_trial_count=2,
        max_failed_trial_count=1,
        parameters=[{"name": "batch_size", "type": "discrete", "values": [100, 200]}],
    )
    with pytest.raises(TuningFailedError) as err:
        tune(spec, digits_split)
    message = str(err.value)
    assert "2 trials failed, more than max_failed_trial_count = 1" in message
    assert "Last error: trial 1: InvalidParameterError: batch_size = 200" in message
    assert [t.state for t in trials_of(project, "too-big")] == [TrialState.FAIL] * 2
    assert (project.home_dir / "tuning" / "too-big" / "trials.csv").is_file()  # published anyway
    client = MlflowClient(project.tracking_uri)
    parent = client.search_runs(
        [client.get_experiment_by_name(project.mlflow_experiment).experiment_id],
        filter_string="tags.`imageops.step` = 'tune'",
    )
    assert [run.info.status for run in parent] == ["FAILED"]


@pytest.mark.slow
def test_early_stopping_prunes_a_trial_worse_than_the_median(
    prefect_api: None, project: Settings, digits_split: tuple[Path, Path]
) -> None:
    # At 16 px a learning rate of 0.05 sends SGD's validation loss into the thousands after one
    # epoch, while 1e-5 keeps it near ln(3): trial 0 (1e-5) completes, trial 1 (0.05) is pruned
    # after epoch 1 of 2. Two processes per trial: every rank must stop together. The Azure
    # recipe's SGD, without warm-up, as these rates were measured with (the default is modern).
    spec = make_spec(
        study_name="pruning",
        algorithm="grid",
        metric="val/loss",
        goal="minimize",
        max_trial_count=2,
        early_stopping=True,
        early_stopping_min_trials=1,
        early_stopping_min_epochs=1,
        parameters=[{"name": "learning_rate", "type": "discrete", "values": [1e-5, 0.05]}],
        train={**TRAIN, "epochs": 2, "nproc_per_node": 2, "recipe": "azure"},
    )
    result = tune(spec, digits_split, register_best=False)

    first, second = trials_of(project, "pruning")
    assert first.state == TrialState.COMPLETE and list(first.intermediate_values) == [1, 2]
    assert second.state == TrialState.PRUNED and list(second.intermediate_values) == [1]
    assert second.intermediate_values[1] > first.intermediate_values[1]
    pruned = result.trials[1]
    client = MlflowClient(project.tracking_uri)
    assert [m.step for m in client.get_metric_history(pruned.run_id, "val/loss")] == [1]
    assert client.get_run(pruned.run_id).data.tags["imageops.trial_state"] == "PRUNED"
    run_dir = project.runs_dir / str(pruned.run_id)
    for rank in (0, 1):  # both ranks heard the decision and stopped after epoch 1
        assert "pruned: val/loss" in (run_dir / f"rank_{rank}.log").read_text()
    assert result.best is not None and result.best.number == 0


@pytest.mark.slow
def test_a_study_on_the_pool_stopped_then_continued_here_goes_on_where_it_stopped(
    prefect_api: None, project: Settings, digits_split: tuple[Path, Path]
) -> None:
    """The study's first trial runs as a flow run of the trial deployment on a worker of the
    work pool; the study, stopped mid-trial, is then continued in this process."""
    parameters = [
        {"name": "learning_rate", "type": "double", "min": 1e-5, "max": 1e-3, "scale": "log"},
        {"name": "batch_size", "type": "discrete", "values": [8, 16]},
    ]
    # One trial first (two at a time is shown by the grid, and below by the Bayesian search).
    first = make_spec(
        study_name="resumed",
        algorithm="random",
        max_trial_count=1,
        parallel_trial_count=2,
        parameters=parameters,
    )
    with trial_worker(project):
        tune(
            first,
            digits_split,
            register_best=False,
            trial_deployment="imageops-tune-trial/tune-trial",
        )
    with get_client(sync_client=True) as prefect:
        (flow_run,) = prefect.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["resumed-trial-0"]))
        )
    assert flow_run.state_type.value == "COMPLETED"  # the trial's own flow run, on the pool
    before = trials_of(project, "resumed")
    assert [t.state for t in before] == [TrialState.COMPLETE]

    # A flow killed mid-trial leaves its trial RUNNING: made here through the storage.
    storage = open_storage(storage_ref(project, "resumed"), project)
    study = optuna.load_study(study_name="resumed", storage=storage)
    leftover = study.ask()
    leftover.suggest_float("learning_rate", 1e-5, 1e-3, log=True)
    leftover.suggest_categorical("batch_size", [8, 16])

    # The same study, continued with more trials (and the Bayesian search now).
    more = first.model_copy(update={"algorithm": "bayesian", "max_trial_count": 3})
    result = tune(more, digits_split, register_best=False)

    trials = trials_of(project, "resumed")
    assert [t.number for t in trials] == [0, 1, 2, 3]  # numbering continues
    assert [(t.datetime_complete, t.params) for t in trials[:1]] == [
        (t.datetime_complete, t.params) for t in before
    ]  # the finished trial was not run again
    interrupted, rerun, new = trials[1:]
    assert interrupted.state == TrialState.FAIL and interrupted.user_attrs["imageops.interrupted"]
    assert rerun.params == leftover.params and rerun.user_attrs["imageops.resumes"] == 1
    assert rerun.state == new.state == TrialState.COMPLETE
    assert overlapped([rerun, new]) == 2  # Bayesian: two at a time
    # The re-run trains in the interrupted trial's folder (its checkpoint, if it had one).
    by_number = {t.number: t for t in result.trials}
    assert (
        by_number[2].model_dir == project.home_dir / "tuning" / "resumed" / "trial_0001" / "model"
    )
    assert by_number[1].interrupted
    client = MlflowClient(project.tracking_uri)
    nested = client.search_runs(
        [client.get_experiment_by_name(project.mlflow_experiment).experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{result.parent_run_id}'",
    )
    assert sorted(run.data.tags["imageops.trial"] for run in nested) == ["0", "2", "3"]


@contextlib.contextmanager
def trial_worker(project: Settings) -> Iterator[None]:
    """A worker of the work pool, played by `serve` in a process of its own (a flow run process
    per trial, as on a pool), with the trial deployment registered; it shares this machine's
    journal file, MLflow and folders."""
    from prefect.settings import PREFECT_API_URL

    env = {
        **os.environ,
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
        "PYTHONPATH": str(ROOT),
    }
    serve = "from flows.tune import trial_flow; trial_flow.serve(name='tune-trial')"
    log = project.home_dir / "trial-worker.log"
    worker = servers.start([sys.executable, "-c", serve], log, env, cwd=project.project_root)
    try:

        def registered() -> bool:  # the worker has registered the deployment
            assert worker.poll() is None, log.read_text()
            with contextlib.suppress(Exception), get_client(sync_client=True) as prefect:
                return bool(prefect.read_deployment_by_name("imageops-tune-trial/tune-trial"))
            return False

        assert servers.wait_until(registered, 120, **LONG_WAIT), log.read_text()
        yield
    finally:
        servers.stop(worker, timeout_s=30)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_parallel_cuda_trials_train_on_gpus_of_their_own(
    prefect_api: None, project: Settings, digits_split: tuple[Path, Path]
) -> None:
    # Two trials at a time on CUDA, each on GPUs of its own (one GPU: they take turns).
    spec = make_spec(
        study_name="on-gpus",
        algorithm="grid",
        max_trial_count=2,
        parallel_trial_count=2,
        parameters=[{"name": "print_frequency", "type": "categorical", "values": [1, 3]}],
        train={**TRAIN, "device": "cuda"},
    )
    result = tune(spec, digits_split, register_best=False)

    client = MlflowClient(project.tracking_uri)
    runs, lent = [], []
    for trial in result.trials:
        assert trial.state == "COMPLETE", trial.error
        run = client.get_run(trial.run_id)
        runs.append(run)
        lent.append(set(run.data.tags["imageops.gpus"].split(",")))
        assert len(lent[-1]) == 1 and lent[-1] <= set(local_gpus().devices)
        # The workers saw exactly the GPU lent to the trial.
        log = (project.runs_dir / run.info.run_id / "rank_0.log").read_text()
        assert f"on cuda:0 (CUDA_VISIBLE_DEVICES={run.data.tags['imageops.gpus']})" in log
    first, second = runs
    together = (
        first.info.start_time < second.info.end_time
        and second.info.start_time < first.info.end_time
    )
    assert not (together and lent[0] & lent[1])  # a GPU is never lent to two trials at once
    assert together or len(local_gpus()) < 2  # with 2 GPUs, both trials ran at once


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_local_cuda_trials_on_a_machine_without_gpus_are_refused_before_any_trial(
    prefect_api: None, project: Settings, digits_split: tuple[Path, Path]
) -> None:
    devices = {"name": "device", "type": "categorical", "values": ["cpu", "cuda"]}
    spec = make_spec(study_name="no-gpus", parameters=[devices])
    with pytest.raises(InvalidTuningSpecError) as err:
        tune(spec, digits_split)
    assert "device = 'cuda' and nproc_per_node = 1: 1 GPU each, and this machine has 0" in str(
        err.value
    )
    assert not (project.home_dir / "tuning").exists()  # no study, no trial
