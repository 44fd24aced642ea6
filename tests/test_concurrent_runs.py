"""Pipeline runs at once: on different data sets they run side by side, each with its own data,
outputs, MLflow run, registered version and DVC state; on the same data set they take turns."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
import yaml
from mlflow.tracking import MlflowClient
from prefect_runs import prefect_rows
from server_processes import Processes, base_env

from flows.config import PipelineConfig
from tasks.data.datasets import dataset_lock
from tasks.data.imagedir import read_manifest
from tasks.shared import faults, servers
from tasks.shared.errors import DatasetBusyError, InvalidParameterError
from tasks.shared.settings import Settings


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ("data/raw/digits", "digits"),
        ("/elsewhere/letters.zip", "letters"),
        ("scans.tar.gz", "scans"),
        ("scans.TGZ", "scans"),
        ("v1.2_cats-dogs/", "v1.2_cats-dogs"),
    ],
)
def test_a_data_set_is_named_after_its_source(source: str, name: str) -> None:
    assert PipelineConfig(source=source).dataset_name == name
    # a name given wins over the source's
    assert PipelineConfig(source=source, dataset="mine").dataset_name == "mine"


@pytest.mark.parametrize("name", ["my set", ".hidden", "a/b", "..", "raw", "repro", "x" * 101])
def test_a_name_that_is_not_one_safe_folder_is_refused(name: str) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        PipelineConfig.checked({"dataset": name}, "imageops run", "hint")
    assert "dataset" in caught.value.message and "--dataset" in caught.value.message


def test_a_source_whose_name_is_not_usable_asks_for_one() -> None:
    with pytest.raises(InvalidParameterError, match="--dataset NAME"):
        PipelineConfig.checked({"source": "my photos.zip"}, "imageops run", "hint")
    config = PipelineConfig.checked(
        {"source": "my photos.zip", "dataset": "photos"}, "imageops run", "hint"
    )
    assert config.dataset_name == "photos"


def test_a_source_that_overlaps_its_data_set_folder_is_refused(project: Settings) -> None:
    from flows.pipeline import pipeline

    inside = project.data_path / "digits" / "raw"
    for config in (
        PipelineConfig(source=str(inside), dataset="digits"),  # source inside data/digits
        PipelineConfig(source=str(project.data_path), dataset="digits"),  # data/digits inside
    ):
        with pytest.raises(InvalidParameterError) as caught:
            pipeline.fn(config)
        assert "--dataset" in caught.value.hint
    assert not (project.data_path / "digits").exists()  # refused before anything was written


def test_a_second_run_on_the_same_data_set_waits_for_the_first(
    project: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    entered = threading.Event()

    def second() -> None:
        with dataset_lock(project, "digits"):
            entered.set()

    caplog.set_level(logging.INFO, logger="tasks.shared.project_lock")
    with dataset_lock(project, "digits"):
        other = threading.Thread(target=second)
        other.start()
        deadline = time.monotonic() + 60
        while "waiting for another run using data set digits" not in caplog.text:
            assert time.monotonic() < deadline, "the second holder never said it waits"
            time.sleep(0.01)
        assert not entered.is_set()  # it waits while the first holds the data set
        with dataset_lock(project, "other"):  # another data set does not wait
            pass
    assert entered.wait(timeout=60)  # and goes on once the first is done
    other.join()
    with (
        dataset_lock(project, "digits"),
        pytest.raises(DatasetBusyError, match="digits") as caught,
        dataset_lock(project, "digits", timeout_s=0.1),
    ):
        pass
    assert "--dataset" in caught.value.hint


def test_two_processes_opening_a_new_mlflow_database_at_once(tmp_path: Path) -> None:
    # The first use of a SQLite store creates and migrates its tables; two at once used to fail
    # in one of them (alembic: "expected to match one row").
    code = (
        "from tasks.shared.settings import get_settings; "
        "from tasks.shared.tracking import configure_mlflow; "
        "print(configure_mlflow(get_settings()))"
    )
    env = base_env() | {"IMAGEOPS_PROJECT_ROOT": str(tmp_path)}
    both = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            cwd=tmp_path,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    outputs = []
    for proc in both:
        try:
            out, err = proc.communicate(timeout=300)
        finally:
            proc.kill()
        assert proc.returncode == 0, err[-3000:]
        outputs.append(out.split()[-1])
    assert outputs[0] == outputs[1]  # one experiment, which both found or made


def _lock_order(trace: Path) -> Callable[[str, str], int]:
    """Where in the fault trace (tasks.shared.faults) data set ``name``'s lock was taken or given
    back."""
    lines = [line.split(" ", 1)[1] for line in trace.read_text().splitlines()]

    def at(point: str, name: str) -> int:
        (index,) = [i for i, line in enumerate(lines) if line == f"lock.{point} name=data-{name}"]
        return index

    return at


@pytest.mark.slow
def test_two_runs_on_different_data_sets_at_once(project: Settings, tmp_path: Path) -> None:
    from dvc.repo import Repo

    from tasks.data.sample import write_digits

    sources = tmp_path / "sources"
    low = write_digits(sources / "low", size=8, classes=[0, 1, 2], per_class=20)
    high_folder = write_digits(sources / "tmp-high", size=8, classes=[3, 4, 5], per_class=20)
    high = Path(shutil.make_archive(str(sources / "high"), "zip", root_dir=high_folder))
    params = tmp_path / "params.yaml"
    params.write_text(
        yaml.safe_dump(
            {
                "transform": {"resize_size": 8, "center_crop_size": 8},
                "split": {"fraction": 0.8},
                "train": {"batch_size": 16, "learning_rate": 0.01},
                "quantize": False,  # a step with no lock of its own: it shows nothing here
            }
        )
    )
    trace = tmp_path / "trace"  # every lock taken and given back, in order, by both runs
    env = base_env() | {
        "IMAGEOPS_PROJECT_ROOT": str(project.project_root),
        "IMAGEOPS_HOME": str(project.home_dir),
        faults.TRACE: str(trace),
    }
    run = [sys.executable, "-m", "app.cli", "run", "--config", str(params),
           "--epochs", "1", "--nproc-per-node", "1"]  # fmt: skip
    processes = Processes(tmp_path / "logs")
    try:
        runs = {
            name: processes.start(name, [*run, str(source)], env)
            for name, source in (("low", low), ("high", high))
        }
        ended = servers.wait_until(
            lambda: all(proc.poll() is not None for proc in runs.values()), 600, interval_s=0.5
        )
        assert ended, f"runs still going\n{processes.report()}"
        assert all(proc.returncode == 0 for proc in runs.values()), processes.report()
    finally:
        processes.stop()

    classes = {"low": ["0", "1", "2"], "high": ["3", "4", "5"]}
    database = project.home_dir / "prefect" / "prefect.db"
    # Both flow runs, each from its own temporary API server, are in the project's one database.
    flows = prefect_rows(
        database, "SELECT id, name, state_type FROM flow_run WHERE name LIKE 'pipeline-%'"
    )
    assert sorted(state for _, _, state in flows) == ["COMPLETED", "COMPLETED"], flows
    # They overlapped: each took its data set's lock before the other gave its own back (one after
    # the other, the second would take its lock after the first gave its lock back).
    at = _lock_order(trace)
    assert at("acquired", "low") < at("released", "high")
    assert at("acquired", "high") < at("released", "low")

    client = MlflowClient(project.tracking_uri, project.registry_uri)
    experiment = client.get_experiment_by_name(project.mlflow_experiment)
    mlflow_runs = client.search_runs([experiment.experiment_id])
    assert len(mlflow_runs) == 2
    versions = client.search_model_versions(f"name = '{project.registered_model_name}'")
    assert sorted(int(v.version) for v in versions) == [1, 2]
    for name, wanted in classes.items():
        data = project.data_path / name
        md5 = yaml.safe_load((data / "images.dvc").read_text())["outs"][0]["md5"]
        (run,) = [r for r in mlflow_runs if r.data.tags["imageops.data_version.images"] == md5]
        assert run.info.status == "FINISHED"
        (version,) = [v for v in versions if v.run_id == run.info.run_id]
        assert version.tags["data_md5.images"] == md5
        assert {p.name for p in data.glob("*.dvc")} == {"images.dvc", "train.dvc", "val.dvc"}
        # Its flow run and its own outputs folder are named after the data set (and the folder
        # after the run); its scored table holds exactly its own validation images and classes.
        (flow_id,) = [i for i, n, _ in flows if n == f"pipeline-resnet18-{name}-data-{md5[:8]}"]
        (outputs,) = (project.home_dir / "outputs").glob(f"*-{name}-*")
        assert outputs.name.endswith(f"-{name}-{flow_id[:8]}")
        table = pd.read_csv(outputs / "scored.csv", dtype={"category": str, "Scored Labels": str})
        val = read_manifest(data / "val")
        assert sorted(table["path"]) == sorted(entry.path for entry in val.images)
        assert sorted(set(table["category"])) == wanted == val.classes
        assert [c.removeprefix("Scored Probabilities_") for c in table.columns if "Prob" in c] == (
            wanted
        )
    # Promotions took turns: the later decision measured its model against the earlier one's
    # (at once, both would have found no champion and taken it) and, its classes being another
    # data set's, left the earlier champion in place, whose own record stands.
    tags = {str(v.version): v.tags for v in versions}
    (later,) = [v for v, t in tags.items() if t["promotion"] == "not promoted"]
    (earlier,) = set(tags) - {later}
    assert json.loads(tags[later]["promotion.details"])["champion_version"] == int(earlier)
    assert "other classes" in tags[later]["promotion.record"]
    assert tags[earlier]["promotion.record"].startswith("promoted to @champion")
    assert f"against v{later}, " in tags[earlier]["promotion.defended"]
    assert tags[earlier]["champion"] == "yes"
    champion = client.get_model_version_by_alias(project.registered_model_name, "champion")
    assert str(champion.version) == earlier
    with Repo(str(project.project_root)) as repo:
        assert repo.status() == {}
