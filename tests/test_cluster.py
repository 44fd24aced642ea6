"""Training and scoring on a real Ray cluster of one machine: the same run as torchrun gives, the
same table as one-machine scoring, and the errors of a job that cannot start (wrong address,
fewer nodes than asked, data a node cannot get).

A Ray head (`ray start --head --block`), an MLflow server and an S3 server run for the module;
the node has an IMAGEOPS_HOME of its own, so it gets the data from the DVC remote like a machine
of its own would, and the S3 keys in its environment, as a team's join file gives them. Two
machines that share nothing: tests/test_cluster_hosts.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import pytest
from mlflow import MlflowClient
from projects import imageops
from server_processes import LONG_WAIT, RAY_NODE, Processes, base_env, free_port
from training_runs import PRE

from models.directory import read_model_info
from tasks.cluster import health as gang_health
from tasks.cluster.connect import connect, leave
from tasks.cluster.job import stopped_whole
from tasks.cluster.node_settings import server_settings
from tasks.data.transform import input_size, per_batch_steps, transform_for
from tasks.inference.score import CHECKPOINTS, score, score_in_shards
from tasks.inference.score.on_cluster import ClusterScoring, _read_batch, score_on_cluster
from tasks.inference.score.s3_table import read_parts
from tasks.shared import faults, servers
from tasks.shared.errors import ClusterUnavailableError, DataUnavailableError, ObjectStoreError
from tasks.shared.object_store import S3Server, S3Url, s3_client
from tasks.shared.servers import healthy
from tasks.shared.settings import Settings
from tasks.train.cluster_node import _file_states, _kept_files, _log_by_ranks, _written
from tasks.train.launch import train
from tasks.train.loop import METRICS
from tasks.train.request import TrainRequest
from tasks.train.run_folder import run_logs
from tasks.train.torchrun import run_torchrun

pytest_plugins = ["training_runs", "model_fixtures"]

FAST = {"batch_size": 8, "learning_rate": 0.01, "device": "cpu", "precision": "fp32"}
RAY = str(Path(sys.executable).with_name("ray"))


# The node's ONNX Runtime fails to make a session for a model folder named so (a node's GPU,
# memory or onnxruntime failing where the driver's did not): a fault in the node's environment.
UNLOADABLE = "unloadable-here"


class Cluster:
    """A one-machine Ray cluster and an MLflow server; ``node_home`` is the node's own folder.

    The node's processes carry one fault (IMAGEOPS_FAULT, tasks/shared/faults.py): a scoring
    actor's session fails for a model folder named UNLOADABLE, and for no other."""

    def __init__(self, root: Path, s3: S3Server) -> None:
        self.processes = Processes(root / "logs")
        self.node_home = root / "node-home"
        # Ray's socket paths must stay short: its session folder lives directly under /tmp.
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
        port, mlflow_port = free_port(), free_port()
        self.address = f"127.0.0.1:{port}"
        self.mlflow = f"http://127.0.0.1:{mlflow_port}"
        try:
            self._start(port, mlflow_port, root, s3)
        except BaseException:
            self.stop()  # a server that never answered is not left running
            raise

    def _start(self, port: int, mlflow_port: int, root: Path, s3: S3Server) -> None:
        env = base_env() | RAY_NODE | s3.environment()
        env |= {"RAY_USAGE_STATS_ENABLED": "0", "IMAGEOPS_HOME": str(self.node_home),
                faults.FAULT: f"score.actor_session:model={UNLOADABLE}:raise"}  # fmt: skip
        # Without it the head takes a token when ~/.ray/auth_token exists (any local ray.init()
        # writes one), which a driver given the address never sends: every job was refused.
        env["RAY_AUTH_MODE"] = "disabled"
        self.ray_head = self.processes.start(
            "ray-head",
            [RAY, "start", "--head", "--block", "--port", str(port), "--num-cpus", "2",
             "--node-ip-address", "127.0.0.1", "--include-dashboard=false",
             "--disable-usage-stats", "--temp-dir", str(self.ray_tmp)],
            env,
        )  # fmt: skip
        self.processes.start(
            "mlflow",
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
             "--port", str(mlflow_port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
             "--artifacts-destination", (root / "mlartifacts").as_uri()],
            base_env(),
        )  # fmt: skip
        # Generous: on a loaded 2-core machine MLflow's first start has taken 160 s.
        self.processes.wait("MLflow", lambda: healthy(f"{self.mlflow}/health"), 300)
        self.processes.wait("the Ray head", lambda: _listening(port), 120)

    def stop(self) -> None:
        import ray

        ray.shutdown()
        self.processes.stop()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[Cluster]:
    running = Cluster(tmp_path_factory.mktemp("cluster"), s3_server)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def on_cluster(
    project: Settings, cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Settings:
    """This test's project, tracking to the cluster's MLflow, checkpoints in a store folder."""
    monkeypatch.setenv("IMAGEOPS_MLFLOW_TRACKING_URI", cluster.mlflow)
    monkeypatch.setenv("IMAGEOPS_CHECKPOINT_URL", str(tmp_path / "checkpoints"))
    monkeypatch.setenv("IMAGEOPS_MLFLOW_EXPERIMENT", f"cluster-{tmp_path.name}")
    return Settings()


@pytest.fixture
def data(project: Settings, digits_split: tuple[Path, Path]) -> tuple[Path, Path]:
    """The digits inside the project: what DVC versions, every node gets."""
    return tuple(  # type: ignore[return-value]
        Path(shutil.copytree(path, project.data_path / "digits" / path.name))
        for path in digits_split
    )


def request(untrained: Path, data: tuple[Path, Path], out: Path, **params: object) -> TrainRequest:
    train_data, val_data = data
    return TrainRequest(
        model=untrained, train_data=train_data, val_data=val_data, out=out,
        params={**FAST, **params}, transform=PRE,
    )  # fmt: skip


@pytest.mark.slow
def test_a_job_on_the_cluster_is_one_run_with_every_epoch_once(
    cluster: Cluster,
    on_cluster: Settings,
    untrained: Path,
    data: tuple[Path, Path],
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    # "auto": node 0 decides it (importing torch in a thread of its own, started with the actor).
    job = request(untrained, data, tmp_path / "model", epochs=2, nproc_per_node=2,
                  cluster=cluster.address, precision="auto")  # fmt: skip
    # Kept once FINISHED, to see what was stored (by default they go: tests/test_gc.py).
    result = train(job, on_cluster.model_copy(update={"keep_checkpoints": True}))
    printed = capfd.readouterr()
    # Ray's notice that ray.init ran outside the main thread is none of the user's business.
    assert "SIGTERM handler" not in printed.out + printed.err, printed.err

    client = MlflowClient(on_cluster.tracking_uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["world_size"] == "2"
    assert run.data.params["resolved_precision"] == "fp32"  # a 16 px input: fp32 on any CPU
    for name in METRICS:  # every epoch once
        assert sorted(m.step for m in client.get_metric_history(result.run_id, name)) == [1, 2]
    # the node got both data sets from the DVC remote, by md5, into its own folder
    assert {"train", "val"} <= {k.rsplit(".", 1)[-1] for k in run.data.tags if "data_version" in k}
    assert len(list((cluster.node_home / "data-versions").glob("*"))) >= 2
    logs = {Path(a.path).name for a in client.list_artifacts(result.run_id, "logs")}
    # the node's torchrun log is named by the ranks it ran, not by its index in the gang
    assert {"rank_0.log", "rank_1.log", "torchrun_ranks_0-1.log"} <= logs
    assert not [name for name in logs if name.startswith("torchrun_node")], logs
    # one compute thread per process, as on one machine (Ray's OMP_NUM_THREADS is the actor's
    # CPUs, which each of its 2 processes took whole: 7x slower per step)
    rank_log = Path(client.download_artifacts(result.run_id, "logs/rank_1.log", str(tmp_path)))
    assert ", 1 compute threads," in rank_log.read_text()
    assert (result.model_dir / "model.safetensors").is_file()
    # the last checkpoint and the best weights are in the store, for a restart elsewhere
    stored = {p.name for p in (tmp_path / "checkpoints" / result.run_id).iterdir()}
    assert stored == {"checkpoint.pt", "best.safetensors"}


def test_a_node_sends_what_its_launch_wrote_named_by_the_ranks_it_ran(tmp_path: Path) -> None:
    """On an earlier gang this machine ran ranks 0-1; torchrun (c10d numbers the nodes itself)
    now gives it ranks 2-3 while another machine runs 0-1: the old files stay here, or they would
    overwrite that machine's in the driver's run folder."""
    run_dir, out = tmp_path / "run", tmp_path / "model"
    run_dir.mkdir()
    for stale in ("rank_0.log", "rank_1.log", "torchrun_ranks_0-1.log", "training_curves.png"):
        (run_dir / stale).write_text("the earlier gang\n")
    (run_dir / "torchrun_ranks_2-3.log").write_text("an earlier launch with ranks 2-3\n")
    before = _file_states(run_dir)
    # a launch as torchrun's: its workers write their rank logs, torchrun prints
    workers = "import sys\nfor r in (2, 3): open(f'{sys.argv[1]}/rank_{r}.log', 'w')\nprint('hi')"
    launch_log = run_dir / "torchrun.log"
    launch = [sys.executable, "-c", workers, str(run_dir)]
    assert run_torchrun(launch, {}, run_dir, None, log_name=launch_log.name) == 0
    log, output = _log_by_ranks(run_dir, launch_log, before)
    assert log == run_dir / "torchrun_ranks_2-3.log" and output == "hi\n"
    assert log.read_text() == "an earlier launch with ranks 2-3\nhi\n"
    assert not launch_log.exists()
    sent = _kept_files(run_dir, out, _written(run_dir, before))
    assert sorted(sent) == ["rank_2.log", "rank_3.log", "torchrun_ranks_2-3.log"]
    # what the run's records list, in rank order (rank_10 after rank_2)
    (run_dir / "rank_10.log").touch()
    assert [p.name for p in run_logs(run_dir)][:4] == ["rank_0.log", "rank_1.log", "rank_2.log",
                                                      "rank_3.log"]  # fmt: skip
    assert [p.name for p in run_logs(run_dir)][-2:] == ["torchrun_ranks_0-1.log",
                                                       "torchrun_ranks_2-3.log"]  # fmt: skip


# A driver as the job's: it joins with tasks.cluster.connect (before anything imports Ray), three
# actors (a gang's nodes, or one node before and after a restart) print lines that differ only in
# their numbers, and the driver waits for each to reach its console.
DRIVER = """
import io, logging, sys, time
from tasks.cluster.connect import connect

seen = io.StringIO()
class Tee(io.TextIOBase):
    def write(self, text):
        seen.write(text)
        return sys.__stdout__.write(text)
    def flush(self):
        sys.__stdout__.flush()
sys.stdout = Tee()
connect(sys.argv[1], 60, logging.getLogger("driver"))
import ray

@ray.remote(num_cpus=0)
class Node:
    def say(self, epoch):
        print(f"rank 0 INFO epoch {epoch}/3: train loss 0.{epoch}", flush=True)

nodes = [Node.remote() for _ in range(3)]
ray.get([node.say.remote(epoch) for epoch, node in enumerate(nodes, 1)])
deadline = time.monotonic() + 30
while seen.getvalue().count("train loss") < 3 and time.monotonic() < deadline:
    time.sleep(0.2)
"""


def test_the_driver_prints_every_node_line_once_when_it_comes_and_no_ray_notice(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Ray's log deduplication held back a line another process had printed in other numbers
    and printed it seconds later (out of order, or as "[repeated 2x across cluster]")."""
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, cluster.address], capture_output=True, text=True,
        timeout=240, env=base_env(), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    for epoch in (1, 2, 3):
        assert done.stdout.count(f"epoch {epoch}/3: train loss 0.{epoch}") == 1, done.stdout
    assert "repeated" not in done.stdout
    assert "SIGTERM handler" not in done.stderr, done.stderr


def test_fewer_nodes_than_asked_fail_within_the_wait_naming_what_is_there(
    cluster: Cluster, on_cluster: Settings, untrained: Path, data: tuple[Path, Path],
    tmp_path: Path,
) -> None:  # fmt: skip
    job = request(untrained, data, tmp_path / "model", nodes=2, cluster=cluster.address,
                  cluster_timeout_s=3)  # fmt: skip
    started = time.monotonic()
    with pytest.raises(ClusterUnavailableError) as err:
        train(job, on_cluster)
    assert time.monotonic() - started < 30
    assert f"The cluster at {cluster.address} offered 1 of the 2 nodes" in str(err.value)
    assert "within 3 s" in str(err.value)


def test_a_node_that_cannot_get_the_data_names_the_version_and_the_host(
    cluster: Cluster, on_cluster: Settings, untrained: Path, data: tuple[Path, Path],
    tmp_path: Path,
) -> None:  # fmt: skip
    job = request(untrained, data, tmp_path / "model", cluster=cluster.address)
    missing = "0123456789abcdef0123456789abcdef.dir"  # a version nobody pushed
    job = job.model_copy(update={"data_version": {"train": missing, "val": missing}})
    with pytest.raises(DataUnavailableError) as err:
        train(job, on_cluster)
    assert missing in str(err.value) and on_cluster.dvc_remote in str(err.value)


def test_a_wrong_cluster_address_is_one_error_within_the_wait(
    cluster: Cluster, on_cluster: Settings, untrained: Path, data: tuple[Path, Path],
    tmp_path: Path,
) -> None:  # fmt: skip
    """From the CLI, as a user types it: nothing listens at the address given."""
    nowhere = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = imageops(
        "train", str(untrained), *map(str, data), str(tmp_path / "model"),
        "--cluster", nowhere, "--cluster-timeout-s", "3", "--device", "cpu", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert time.monotonic() - started < 60
    assert result.stderr.count("error: ClusterUnavailableError") == 1, result.stderr
    assert f"Could not reach the Ray cluster at {nowhere}" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_node_agent_that_stops_answering_ends_the_job_within_its_deadline(
    cluster: Cluster, on_cluster: Settings, untrained: Path, data: tuple[Path, Path],
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The node's agent frozen mid-training (SIGSTOP: alive to Ray, deaf to calls): the driver's
    ping goes unanswered and the job ends, naming the node, instead of waiting for ever."""
    monkeypatch.setattr(gang_health, "ANSWER_TIMEOUT_S", 3.0)
    monkeypatch.setattr(gang_health, "HEALTH_EVERY_S", 0.5)
    job = request(untrained, data, tmp_path / "model", epochs=200, cluster=cluster.address)
    job = job.model_copy(update={"max_restarts": 0})
    failures: list[BaseException] = []

    def driver() -> None:
        try:
            train(job, on_cluster)
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=driver, daemon=True)
    thread.start()
    agent = servers.wait_until(lambda: _agent_of_torchrun(cluster.node_home), 120, **LONG_WAIT)
    assert agent, "no torchrun of this cluster's node started"
    agent.suspend()
    try:
        started = time.monotonic()
        thread.join(60)
        assert not thread.is_alive(), "the driver still waits on a node that does not answer"
        assert time.monotonic() - started < 45
    finally:
        with contextlib.suppress(psutil.Error):
            agent.kill()
    (error,) = failures
    assert isinstance(error, ClusterUnavailableError), repr(error)
    assert "did not answer for 3 s" in str(error)
    run = MlflowClient(on_cluster.tracking_uri).search_runs(
        [MlflowClient(on_cluster.tracking_uri).get_experiment_by_name(
            on_cluster.mlflow_experiment).experiment_id]
    )[0]  # fmt: skip
    assert run.info.status == "FAILED"


def _agent_of_torchrun(node_home: Path) -> psutil.Process | None:
    """The Ray actor process whose torchrun trains a run of the node at ``node_home``."""
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if "torch.distributed.run" in command and str(node_home) in command:
            with contextlib.suppress(psutil.Error):
                for parent in process.parents():
                    if parent.name().startswith("ray::") or "ray::" in " ".join(parent.cmdline()):
                        return parent
    return None


@pytest.fixture
def digits_to_score(digits_split: tuple[Path, Path], tmp_path: Path) -> Path:
    """The validation digits with one image damaged: it must come back as an error row."""
    images = shutil.copytree(digits_split[1], tmp_path / "images")
    damaged = next(images.rglob("*.png"))
    damaged.write_bytes(damaged.read_bytes()[:40])
    return images


def test_scoring_on_the_cluster_writes_the_table_one_machine_writes(
    cluster: Cluster, exported_model: Path, digits_to_score: Path, tmp_path: Path
) -> None:
    """`imageops score --cluster`, as a user types it: one Ray Data job, every image one row in
    the images' order, the damaged one an error row, labels and probabilities as on one machine."""
    here = score(exported_model, digits_to_score, tmp_path / "here.parquet", batch_size=4)
    result = imageops(
        "score", str(exported_model), str(digits_to_score), str(tmp_path / "there.parquet"),
        "--batch-size", "4", "--cluster", cluster.address, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    expected, scored = pd.read_parquet(here), pd.read_parquet(tmp_path / "there.parquet")
    assert (scored["Scoring Error"] != "").sum() == 1
    pd.testing.assert_frame_equal(scored, expected, check_exact=False, rtol=1e-5, atol=1e-6)
    assert "Cannot score" in result.stderr  # the error row's image, named in the driver's log


def _job_processes(cluster: Cluster) -> list[str]:
    """The command lines of the cluster's workers running a scoring's reading or actors."""
    found = []
    for process in psutil.Process(cluster.ray_head.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            command = " ".join(process.cmdline())
            if "_Scorer" in command or "_read_batch" in command:
                found.append(command)
    return found


def _stacks_of(driver: subprocess.Popen) -> str:
    """End a stuck driver started with PYTHONFAULTHANDLER=1 in a session of its own: its stderr,
    ending with every thread's stack (SIGABRT), then its whole process group killed (a child
    holding the pipes must not make reading them wait for ever)."""
    driver.send_signal(signal.SIGABRT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        driver.wait(timeout=20)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(driver.pid, signal.SIGKILL)
    return driver.communicate(timeout=30)[1][-12000:]


def test_a_cluster_scoring_from_s3_to_s3_stopped_by_ctrl_c_resumes_with_only_the_rest(
    cluster: Cluster,
    exported_model: Path,
    digits_to_score: Path,
    s3_server: S3Server,
    s3_bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`imageops score s3://... s3://... --cluster`, as a user types it: the nodes read the
    images from S3 themselves; Ctrl-C after the second of five parts ends the job's actors
    within 30 s, even with Ray Data's executor stuck in its shutdown, and leaves no table; the
    same command again scores only the other three parts, and the table is one-machine
    scoring's, every image once."""
    for key, value in s3_server.environment().items():
        monkeypatch.setenv(key, value)
    client = s3_client(s3_server.endpoint_url, s3_server.access_key, s3_server.secret_key)
    for path in digits_to_score.rglob("*"):  # an ImageDirectory: its manifest's order, classes
        if path.is_file():
            key = f"images/{path.relative_to(digits_to_score).as_posix()}"
            client.upload_file(str(path), s3_bucket, key)
    images, dest = S3Url(s3_bucket, "images"), S3Url(s3_bucket, "scores")
    command = [
        sys.executable,
        "-m",
        "app.cli",
        "score",
        str(exported_model),
        str(images),
        str(dest),
        "--batch-size",
        "4",
        "--shard-images",
        "4",
        "--cluster",
        cluster.address,
    ]
    trace = tmp_path / "trace"  # 18 images: 5 parts of 3 or 4; stopped after the second
    # and Ray Data's executor stuck in its shutdown: the stop goes on without it
    held = "score.shard_written:shard=1:hang;score.executor_shutdown:hang"
    stopped = {faults.FAULT: held, faults.TRACE: str(trace)}
    stopped["PYTHONFAULTHANDLER"] = "1"  # SIGABRT prints every thread's stack (the failsafe)
    driver = subprocess.Popen(
        command, cwd=tmp_path, env=os.environ | stopped, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    with contextlib.ExitStack() as cleanup:  # a failed check never waits on a held driver
        cleanup.callback(lambda: driver.poll() is None and _stacks_of(driver))
        seen: list[str] = []  # the job's processes, seen while it ran

        def at_part() -> bool:
            seen.extend(_job_processes(cluster))
            return driver.poll() is not None or bool(
                trace.exists() and faults.reached(trace, "score.shard_written")[1:]
            )

        reached = servers.wait_until(at_part, 240, interval_s=0.2)
        assert reached and driver.poll() is None, _stacks_of(driver)
        # The job ran its actors on the cluster; they may already have scored every image (the
        # driver, held, writes the parts in order), else Ctrl-C must end them.
        assert seen or _job_processes(cluster)
        driver.send_signal(signal.SIGINT)
        started = time.monotonic()
        gone = servers.wait_until(lambda: not _job_processes(cluster), 30, interval_s=0.5)
        if not gone:  # the test fails, and says where the driver's threads were, not hangs
            still = _job_processes(cluster)
            pytest.fail(f"still running 30 s after Ctrl-C: {still}\n{_stacks_of(driver)}")
        assert time.monotonic() - started < 30
        _, err = driver.communicate(timeout=60)
    assert driver.returncode != 0 and "Traceback" not in err, err
    assert "executor did not shut down within 10 s: going on without it" in err, err
    keys = [obj["Key"] for obj in client.list_objects_v2(Bucket=s3_bucket, Prefix="scores/")
            .get("Contents", [])]  # fmt: skip
    assert sorted(k.rsplit("/", 1)[1] for k in keys) == ["part-00000.parquet", "part-00001.parquet"]
    assert all("/_temporary/" in k for k in keys), keys  # no _SUCCESS: no table looks whole

    monkeypatch.setenv(faults.TRACE, str(tmp_path / "again"))
    again = imageops(*command[3:], cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "Reusing 2 of 5 finished shards" in again.stderr
    written = faults.reached(tmp_path / "again", "score.shard_written")
    assert [part["shard"] for part in written] == ["2", "3", "4"]  # the other parts only
    scored = pd.concat(read_parts(dest), ignore_index=True)
    expected = pd.read_parquet(score(exported_model, digits_to_score, tmp_path / "here.parquet"))
    assert scored["id"].tolist() == list(range(18))  # every image once
    failed = scored.pop("Scoring Error") != ""  # its reason names the object, not the file
    assert failed.sum() == 1 and failed.equals(expected.pop("Scoring Error") != "")
    pd.testing.assert_frame_equal(scored, expected, check_exact=False, rtol=1e-5, atol=1e-6)


def test_a_scoring_stopped_with_every_shard_done_is_finished_without_the_cluster(
    exported_model: Path, digits_to_score: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One-machine scoring stopped after its last shard, before the merge: `--cluster` with the
    same settings resumes it (the same checkpoint), merging without asking the cluster (none
    listens at the address)."""
    dest = tmp_path / "scored.parquet"
    options = {"shard_images": 4, "batch_size": 4}
    monkeypatch.setenv(faults.FAULT, "score.shard_written:shard=4:raise")
    with pytest.raises(faults.InjectedFault):
        score_in_shards(exported_model, digits_to_score, dest, threads=1, **options)
    monkeypatch.delenv(faults.FAULT)
    nowhere = f"127.0.0.1:{free_port()}"
    job = ClusterScoring(exported_model, digits_to_score, dest, nowhere, timeout_s=2, **options)
    assert score_on_cluster(job) == dest
    assert pd.read_parquet(dest)["id"].tolist() == list(range(18))
    assert not (tmp_path / CHECKPOINTS).exists()


def test_a_node_whose_keys_s3_refuses_fails_the_job_instead_of_making_error_rows(
    exported_model: Path,
    digits_to_score: Path,
    s3_server: S3Server,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read task on a node whose keys S3 refuses: every image of its batches would have been
    an error row, kept by a rerun (its part finished). The task fails, naming the node; a
    damaged image read with good keys is still its own error row."""
    for key, value in s3_server.environment().items():
        monkeypatch.setenv(key, value)
    damaged = next(digits_to_score.rglob("*.png"))  # as digits_to_score damaged it
    whole = next(p for p in digits_to_score.rglob("*.png") if p != damaged)
    client = s3_client(s3_server.endpoint_url, s3_server.access_key, s3_server.secret_key)
    rels = [p.relative_to(digits_to_score).as_posix() for p in (damaged, whole)]
    for path, rel in zip((damaged, whole), rels, strict=True):
        client.upload_file(str(path), s3_bucket, f"images/{rel}")
    info = read_model_info(exported_model)
    servers = server_settings(Settings())
    for key, value in servers.items():  # a task sets them in its process: undone after the test
        monkeypatch.setenv(key, value)
    reading = {
        "root": S3Url(s3_bucket, "images"),
        "steps": per_batch_steps(transform_for(info.transform, "inference", digits_to_score, None)),
        "side": input_size(info.transform),
        "servers": servers,
    }
    batch = {"id": np.arange(2), "rel": np.array(rels, dtype=object),
             "problem": np.array(["", ""], dtype=object)}  # fmt: skip

    read = _read_batch(batch, **reading)
    assert [bool(e) for e in read["error"]] == [True, False]  # the damaged image, its own row

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")  # keys this S3 does not know
    with pytest.raises(ObjectStoreError, match="refused the keys") as refused:
        _read_batch(batch, **reading)
    assert f"on the cluster's node {socket.gethostname()}" in refused.value.message


def test_a_promotion_on_a_team_scores_on_its_cluster(
    prefect_api: None,
    project: Settings,
    cluster: Cluster,
    exported_model: Path,
    digits_split: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run a promotion starts (the trigger's parameters, rendered for the event of a new
    @champion) on a machine of a team, whose worker has the join file's IMAGEOPS_RAY_ADDRESS:
    one job on the team's cluster, the table one machine writes. In no team: the same parameters
    score on the worker's machine (tests/test_promotion_webhook.py, the whole chain)."""
    import jinja2

    from flows.score import promotion_trigger, score_flow
    from tasks.registry.promotion_events import alias_event
    from tasks.registry.register import register

    name = project.registered_model_name
    version = register(exported_model, settings=project).version
    event = alias_event(name, "champion", version)
    parameters = {
        key: jinja2.Template(value).render(event=event)  # as Prefect renders a trigger's
        for key, value in promotion_trigger(name).parameters.items()
    }
    monkeypatch.setenv("IMAGEOPS_RAY_ADDRESS", cluster.address)
    val, dest = digits_split[1], tmp_path / "scored.parquet"
    try:
        result = score_flow(**parameters, images=str(val), dest=str(dest), batch_size=4)
    finally:
        leave()
    assert (result.model, result.version) == (f"models:/{name}/{version}", version)
    assert result.cluster == cluster.address
    here = score(exported_model, val, tmp_path / "here.parquet", batch_size=4)
    expected, scored = pd.read_parquet(here), pd.read_parquet(dest)
    pd.testing.assert_frame_equal(scored, expected, check_exact=False, rtol=1e-5, atol=1e-6)


def test_an_unreachable_cluster_is_one_error_and_no_table(
    exported_model: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    dest = tmp_path / "scored.csv"
    result = imageops(
        "score", str(exported_model), str(digits_split[1]), str(dest),
        "--cluster", nowhere, "--cluster-timeout-s", "2", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("error: ") == 1, result.stderr
    assert f"error: ClusterUnavailableError: Could not reach the Ray cluster at {nowhere}" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == [".imageops"], "nothing written but settings"


def test_a_model_the_actors_cannot_load_is_one_error_naming_the_node(
    cluster: Cluster, exported_model: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    """`imageops score --cluster`, as a user types it, with a model the driver's check takes and
    the node's actors cannot load: one error naming the model and the node, exit 2, no table."""
    model = shutil.copytree(exported_model, tmp_path / UNLOADABLE)
    dest = tmp_path / "scored.csv"
    result = imageops(
        "score", str(model), str(digits_split[1]), str(dest), "--batch-size", "4",
        "--cluster", cluster.address, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    # the node by its address in the cluster (Ray's, not the 127.0.0.1 it was started with)
    # and its host name
    host, onnx = re.escape(socket.gethostname()), re.escape(str(model / "model.onnx"))
    assert re.match(
        rf"error: ScoringFailedError: The scoring actor on node [\d.]+ \({host}\) "
        rf"could not load {onnx}: InjectedFault: ",
        error,
    ), error
    assert sorted(p.name for p in tmp_path.iterdir()) == [".imageops", UNLOADABLE], "no table"


def test_an_interrupted_job_leaves_the_cluster_and_its_actors_end(cluster: Cluster) -> None:
    """Ctrl-C (or a cancelled flow run's TerminationSignal) in a job's driver: the driver leaves
    the cluster, which ends every actor of the job, those Ray Data started for a scoring too."""
    import ray

    from tasks.train.cluster_node import NodeAgent  # an actor class every node imports

    log = logging.getLogger(__name__)
    connect(cluster.address, 60, log)
    agent = ray.remote(num_cpus=0)(NodeAgent).options(name="job-actor", namespace="stop")
    assert ray.get(agent.remote({}).ping.remote(), timeout=120)
    with pytest.raises(KeyboardInterrupt), stopped_whole():
        raise KeyboardInterrupt
    assert not ray.is_initialized()
    connect(cluster.address, 60, log)
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            try:
                ray.get_actor("job-actor", namespace="stop")
            except ValueError:
                return  # gone
            time.sleep(0.5)
        pytest.fail("the interrupted job's actor still lives 30 s after its driver left")
    finally:
        leave()
