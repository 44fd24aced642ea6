"""A team on two machines that share nothing but the servers, as the docs run it (docs/team.md).

`imageops team server --host <bridge>` runs in the root namespace (PostgreSQL, S3, MLflow,
Prefect, Ray head, each behind a login); hosts A and B (tests/hosts.py: each its own network,
PID namespace and /proc, hostname, checkout and home) each run `imageops team join` (the join
file in the host user's ~/.config/imageops): a Ray node and a Prefect worker. On them: 2-node
trainings through `prefect deployment run` whose Prefect worker, or whose flow-run process, is
SIGKILLed mid-training; a cancelled one; one from the CLI while a host loses power; one scoring
of an S3 prefix by both hosts' Ray nodes, through `prefect deployment run` and through `imageops
score` while a host loses power, and one cancelled by `prefect flow-run cancel` (issue 45); and
the nightly pipeline on the host that did not
prepare the data (issue 44). tests/team_stack.py starts the stack.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pandas as pd
import pytest
from hosts import Host, Hosts, can_make_hosts
from mlflow import MlflowClient
from server_processes import LONG_WAIT
from team_stack import TeamStack

from models.untrained import spec_for, write_untrained
from tasks.data.convert import convert
from tasks.data.sample import write_digits
from tasks.data.transform import init_transformation
from tasks.inference.score import score
from tasks.inference.score.s3_table import read_parts
from tasks.shared import faults, servers
from tasks.shared.object_store import S3Url, s3_client
from tasks.train.loop import METRICS

pytest_plugins = ["model_fixtures"]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(can_make_hosts() is not None, reason=str(can_make_hosts())),
]
PY = sys.executable
SMALL = {"resize_size": 16, "center_crop_size": 16, "random_horizontal_flip": False}
TRAIN = {"epochs": 1, "batch_size": 16, "learning_rate": 0.01, "nproc_per_node": 1,
         "device": "cpu", "precision": "fp32", "nodes": 2}  # fmt: skip
MODEL = "imageops-classifier"
# A small network (1.5 M parameters, resnet18 has 11 M): nothing these tests show depends on it,
# and each checkpoint, upload, export and scoring is that much smaller.
NET = {"name": "mobilenet_v3_small", "pretrained": False}
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")
TRAINING = ("torch.distributed.run", "tasks.train.worker")  # a node's torchrun and its ranks
LOST_DRIVER_S = 300  # issue 44: a job whose driver is SIGKILLed ends FAILED within 5 minutes


@dataclass
class Team:
    """The hosts and the team stack they joined."""

    hosts: Hosts
    stack: TeamStack

    @property
    def a(self) -> Host:
        return self.hosts.hosts[0]

    @property
    def b(self) -> Host:
        return self.hosts.hosts[1]

    @property
    def cluster(self) -> str:
        return self.stack.values["IMAGEOPS_RAY_ADDRESS"]

    @property
    def mlflow(self) -> MlflowClient:
        uri = self.stack.values["IMAGEOPS_MLFLOW_TRACKING_URI"]
        # The registry too: an earlier module in this process may have set MLflow's global one.
        return MlflowClient(tracking_uri=uri, registry_uri=uri)

    def joined(self, host: Host) -> bool:
        """Whether ``host``'s `team join` still runs."""
        proc = self.stack.joins.get(host.name)
        return proc is not None and proc.poll() is None

    def rejoin(self) -> None:
        """Each host in the team again (after an earlier test's failure took one out)."""
        left = [host for host in self.hosts.hosts if not self.joined(host)]
        if left:
            for host in left:
                self.hosts.power_off(host)  # whatever its join left, as a reboot does
            self.stack.join(*left)
            self.wait_for_nodes(2)

    def wait_for_nodes(self, count: int) -> None:
        """Until the Ray cluster counts ``count`` live nodes with CPUs (the head has none)."""
        ask = (
            "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR', "
            "log_to_driver=False); "
            "print(sum(n['Alive'] and n['Resources'].get('CPU', 0) > 0 for n in ray.nodes()))"
        )

        def counted() -> bool:
            done = self.a.run([PY, "-c", ask, self.cluster], timeout_s=60, **self.stack.values)
            return done.returncode == 0 and done.stdout.strip().endswith(str(count))

        wait_for(f"{count} Ray nodes", counted, 180)

    def report(self) -> str:
        return self.hosts.processes.report() + "\n" + self.stack.report()


@pytest.fixture(scope="module")
def team(
    tmp_path_factory: pytest.TempPathFactory, digits_split: tuple[Path, Path]
) -> Iterator[Team]:
    root = tmp_path_factory.mktemp("team")
    with Hosts(root) as hosts:
        stack = TeamStack(hosts)
        try:
            stack.start()
            for host in hosts.hosts:  # each machine has its own checkout of the project's data
                for split in digits_split:
                    shutil.copytree(split, host.project / "data" / "digits" / split.name)
            stack.join(*hosts.hosts)
            with stack.logged_in():
                yield Team(hosts, stack)
        except BaseException:
            print(hosts.processes.report(), stack.report())
            raise
        finally:
            hosts.processes.stop()  # the joins before the server they talk to
            stack.stop()


def cli(host: Host, *args: str, timeout_s: float = 600, **env: str) -> str:
    result = host.run([PY, "-m", "app.cli", *args], timeout_s=timeout_s, COLUMNS="200", **env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def wait_for(
    what: str,
    ready: Callable[[], object],
    timeout_s: float,
    max_interval_s: float = LONG_WAIT["max_interval_s"],
) -> None:
    """Poll ``ready`` (more slowly as the wait goes on, up to ``max_interval_s``)."""
    pacing = LONG_WAIT | {"max_interval_s": max_interval_s}
    assert servers.wait_until(ready, timeout_s, **pacing), f"timed out waiting for {what}"


def training_processes(hosts: Hosts) -> list[str]:
    """The torchrun and rank processes still alive on any host."""
    return [
        f"{host.name}: {pid} {command[:80]}"
        for host in hosts.hosts
        for pid, command in host.processes_running(*TRAINING).items()
        if not command.startswith("nsenter ")
    ]


def program(host: Host, module: str) -> dict[int, str]:
    """The processes of ``host`` that run ``python -m module`` (not their nsenter wrapper)."""
    return {
        pid: command
        for pid, command in host.processes_running(f"-m {module}").items()
        if not command.startswith("nsenter ")
    }


def flow_run_process(team: Team, flow_run: str) -> tuple[Host, int] | None:
    """The host and pid of ``flow_run``'s process (the driver), if one runs it now."""
    for host in team.hosts.hosts:
        for pid in program(host, "app.flow_run_entry"):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            if f"PREFECT__FLOW_RUN_ID={flow_run}".encode() in environ:
                return host, pid
    return None


def run_deployment(team: Team, host: Host, name: str, **params: object) -> str:
    """`prefect deployment run NAME -p k=v ...` on ``host``, as a person who sourced the join
    file; the flow run's id."""
    options = [
        word for k, v in params.items()
        for word in ("-p", f"{k}={v if isinstance(v, str) else json.dumps(v)}")
    ]  # fmt: skip
    started = host.run(
        [PY, "-m", "prefect", "deployment", "run", name, *options],
        timeout_s=120, **team.stack.values,
    )  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    (flow_run,) = re.findall(r"UUID: ([0-9a-f-]{36})", started.stdout)
    return flow_run


def run_train_deployment(team: Team, **params: object) -> str:
    """The train deployment, 2 nodes on the team's Ray cluster, from host A."""
    return run_deployment(
        team, team.a, "imageops-train-model/train", model=NET,
        train_data="data/digits/train", val_data="data/digits/val",
        params=TRAIN | {"cluster": team.cluster} | params, transform=SMALL,
    )  # fmt: skip


def flow_run_state(team: Team, flow_run: str) -> dict:
    with team.stack.prefect() as api:
        return api.get(f"/flow_runs/{flow_run}").raise_for_status().json()["state"]


def final_state(team: Team, flow_run: str, timeout_s: float) -> dict:
    """The flow run's state once final, read from the Prefect API (fails with the logs if not)."""
    seen: list[dict] = [{}]

    def ended() -> bool:
        seen[0] = flow_run_state(team, flow_run)
        return seen[0]["type"] in FINAL

    if not servers.wait_until(ended, timeout_s, **LONG_WAIT):
        pytest.fail(f"flow run {flow_run} still {seen[0].get('type')} after {timeout_s} s\n"
                    f"{team.report()}")  # fmt: skip
    return seen[0]


def training_runs(client: MlflowClient, status: str) -> list:
    experiment = client.get_experiment_by_name("imageops")
    if experiment is None:
        return []
    return client.search_runs([experiment.experiment_id], f"attributes.status = '{status}'")


def wait_until_training(team: Team, flow_run: str) -> tuple[Host, int]:
    """Once a rank runs on each host: the host and pid of the flow run's process."""
    wait_for("a rank on each host", lambda: len(training_processes(team.hosts)) >= 4, 300, 0.5)
    driver = flow_run_process(team, flow_run)
    assert driver is not None, training_processes(team.hosts)
    return driver


# --- the hosts ------------------------------------------------------------------------------


def test_each_host_is_a_machine_of_its_own_in_the_team(team: Team) -> None:
    """PID namespace, /proc, hostname and address of their own; each joined with its Ray node
    and Prefect worker (the Ray head has no CPUs: a 2-node job needs both)."""
    seen = {}
    for host in team.hosts.hosts:
        done = host.run([PY, "-c", (
            "import os, socket\n"
            "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
            "print(socket.gethostname(), os.readlink('/proc/self/ns/pid'), os.getpid())\n"
            "print(sum(b'app.checked_' b'worker' in open(f'/proc/{p}/cmdline', 'rb').read()\n"
            "          for p in pids if os.path.exists(f'/proc/{p}/cmdline')))\n"
        )])  # fmt: skip
        assert done.returncode == 0, done.stderr
        (name, namespace, pid), (workers,) = (line.split() for line in done.stdout.splitlines())
        seen[name] = namespace
        assert name == host.name and int(pid) < 1000  # numbered from 1 in its namespace
        assert workers == "1"  # its own Prefect worker: the other host's is not in its /proc
    assert len(set(seen.values())) == 2 and os.readlink("/proc/self/ns/pid") not in seen.values()
    team.wait_for_nodes(2)
    expected = {f"{h.name}-{h.address}" for h in team.hosts.hosts}
    with team.stack.prefect() as api:

        def online() -> bool:  # a worker is ONLINE from its first heartbeat on
            workers = api.post("/work_pools/local/workers/filter", json={}).json()
            return expected <= {w["name"] for w in workers if w["status"] == "ONLINE"}

        wait_for(f"workers {expected} online", online, 60)


# --- a lost worker, a lost driver, a cancel ----------------------------------------------------


def test_a_job_outlives_its_sigkilled_worker_under_team_join(team: Team) -> None:
    """Issue 44, finding 1: SIGKILL of the Prefect worker (`app.checked_worker` under `team
    join`) whose flow run trains on 2 nodes: the job ends COMPLETED, its MLflow run FINISHED;
    `team join` goes on with a new worker; the other host scores the model from the registry."""
    team.rejoin()
    client = team.mlflow
    flow_run = run_train_deployment(team)
    host, _ = wait_until_training(team, flow_run)
    (worker,) = program(host, "app.checked_worker")
    os.kill(worker, signal.SIGKILL)  # the worker only: its flow run goes on

    state = final_state(team, flow_run, 540)
    assert state["type"] == "COMPLETED", f"{state}\n{team.report()}"
    version = client.get_model_version_by_alias(MODEL, "challenger")
    run = client.get_run(version.run_id)
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"
    assert team.joined(host), team.report()
    wait_for(
        "a new Prefect worker", lambda: set(program(host, "app.checked_worker")) - {worker}, 120
    )
    other = team.b if host is team.a else team.a
    # The other host never saw this model: it gets it from the registry (artifacts in S3).
    cli(other, "score", f"models:/{MODEL}/{version.version}", "data/digits/val", "scored.csv",
        **team.stack.values)  # fmt: skip
    rows = (other.project / "scored.csv").read_text().splitlines()
    assert len(rows) > 10 and rows[0].startswith("id,path,category")


def test_a_cancelled_flow_run_stops_the_cluster_job_within_30_seconds(team: Team) -> None:
    """After a worker's restart too: `prefect flow-run cancel` ends CANCELLED, every training
    process of both hosts gone within 30 s, the MLflow run KILLED."""
    team.rejoin()
    flow_run = run_train_deployment(team, epochs=50)
    wait_until_training(team, flow_run)
    cancelled = team.a.run([PY, "-m", "prefect", "flow-run", "cancel", flow_run],
                           **team.stack.values)  # fmt: skip
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    started = time.monotonic()
    wait_for("every training process to stop", lambda: not training_processes(team.hosts), 30)
    assert time.monotonic() - started < 30
    state = final_state(team, flow_run, 240)  # the API hears it late when busy
    assert state["type"] == "CANCELLED", f"{state}\n{team.report()}"
    # KILLED by the job, else by the team server's loop (every 10 s) once the run is CANCELLED
    wait_for("the MLflow run KILLED", lambda: not training_runs(team.mlflow, "RUNNING"), 60)
    assert training_runs(team.mlflow, "KILLED")


def test_a_job_whose_flow_run_process_is_sigkilled_fails_within_5_minutes(team: Team) -> None:
    """Issue 44, finding 1: SIGKILL of the flow-run process (the driver) of a 2-node training:
    CRASHED or FAILED in Prefect and FAILED in MLflow within 5 minutes, no rank left anywhere."""
    team.rejoin()
    client = team.mlflow
    flow_run = run_train_deployment(team, epochs=50)
    _, driver = wait_until_training(team, flow_run)
    wait_for("the MLflow run", lambda: training_runs(client, "RUNNING"), 120, 0.5)
    (run,) = training_runs(client, "RUNNING")
    os.kill(driver, signal.SIGKILL)
    killed = time.monotonic()

    def ended() -> bool:
        final = flow_run_state(team, flow_run)["type"] in ("CRASHED", "FAILED")
        return final and client.get_run(run.info.run_id).info.status == "FAILED"

    if not servers.wait_until(ended, LOST_DRIVER_S, **LONG_WAIT):
        pytest.fail(
            f"after {LOST_DRIVER_S} s: flow run {flow_run_state(team, flow_run)}, MLflow run "
            f"{client.get_run(run.info.run_id).info.status}\n{team.report()}"
        )
    left = LOST_DRIVER_S - (time.monotonic() - killed)
    wait_for("every training process to stop", lambda: not training_processes(team.hosts), left)


# --- a host that loses power ----------------------------------------------------------------


def epoch_ended(trace: Path) -> bool:
    return trace.exists() and bool(faults.reached(trace, "train.epoch_end"))


def train_command(host: Host, cluster: str, **params: object) -> list[str]:
    """`imageops train` of a fresh NET on the digits at 16 px, as typed on ``host``."""
    write_untrained(spec_for(NET["name"]), host.project / "untrained")
    init_transformation(host.project / "transform", SMALL)
    options = [f"--{k.replace('_', '-')}={v}" for k, v in (TRAIN | params).items()]
    return [PY, "-m", "app.cli", "train", "untrained", "data/digits/train", "data/digits/val",
            "model", "--cluster", cluster, "--transform", "transform", *options]  # fmt: skip


def test_a_two_node_job_from_the_cli_survives_a_host_losing_power(team: Team) -> None:
    """`imageops train --nodes 2` on host A: a rank on each host, meeting at a host's address.
    Host B loses power right after epoch 1; the job goes on from epoch 1's checkpoint (in S3)
    once B has joined again, and MLflow has every epoch once."""
    team.rejoin()
    a, b, hosts = team.a, team.b, team.hosts
    trace = b.root / "fault-trace"
    hosts.power_off(b)  # B rejoins with the fault armed: its rank stops after epoch 1
    team.stack.join(b, IMAGEOPS_FAULT="train.epoch_end:epoch=1:stop",
                    IMAGEOPS_FAULT_TRACE=str(trace))  # fmt: skip
    team.wait_for_nodes(2)  # the dead B is no longer counted, the armed one is
    driver = subprocess.Popen(
        a.command(train_command(a, team.cluster, epochs=2)),
        env=a.env | team.stack.values | {"COLUMNS": "200"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_for("host B's rank at the end of epoch 1", lambda: epoch_ended(trace), 300)
        hosts.power_off(b)
        time.sleep(2)
        team.stack.join(b)  # capacity is back
        printed, _ = driver.communicate(timeout=400)
    finally:
        driver.kill()
    assert driver.returncode == 0, printed
    assert "the job starts again from its last checkpoint" in printed
    (run_id,) = re.findall(r"MLflow run: (\w+)", printed)
    client = team.mlflow
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"
    assert (a.project / "model" / "model.safetensors").is_file()
    for name in METRICS:  # each epoch logged once
        assert sorted(m.step for m in client.get_metric_history(run_id, name)) == [1, 2], name
    logs = client.download_artifacts(run_id, "logs", str(a.root / "lost-node-logs"))
    rank_logs = "".join(p.read_text() for p in Path(logs).glob("rank_*.log"))
    assert "resumed from the checkpoint after epoch 1" in rank_logs
    # One node's processes per host, and the ranks met at a host's address on its own interface
    # (never at loopback), on each attempt.
    ranks_on = r"rank \d of 2 on cpu, \d+ compute threads, on host ([^,\s]+)"
    assert set(re.findall(ranks_on, rank_logs)) == {"host-a", "host-b"}
    meetings = set(re.findall(r"meeting at ([\d.]+):\d+ via (\w+)", rank_logs))
    assert meetings and meetings <= {(a.address, "eth0"), (b.address, "eth0")}
    # host B trained on data it fetched from the DVC remote (S3): both versions
    assert len(list((b.project / ".imageops" / "data-versions").iterdir())) >= 2


# --- one scoring on both hosts --------------------------------------------------------------


@dataclass(frozen=True)
class Scoring:
    """Images in the team's S3, the model every host has in its checkout, one machine's table."""

    images: S3Url
    model: str  # the ModelDirectory, relative to each host's checkout
    expected: pd.DataFrame  # one-machine scoring of the same images


SCORING_BUCKET = "imageops"  # the team's bucket (app/team.py)
SCORING_OPTIONS = {"batch_size": 8, "shard_images": 100}  # 3 parts of 100 images


@pytest.fixture(scope="module")
def scoring(team: Team, exported_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Scoring:
    """300 digits (16 px PNGs, an ImageDirectory) uploaded under s3://imageops/scoring/images,
    the session's exported model copied into each host's checkout."""
    root = tmp_path_factory.mktemp("scoring")
    raw = write_digits(root / "raw", size=16, classes=[0, 1, 2], per_class=100)
    folder = root / "images"
    convert(raw, folder)
    values = team.stack.values
    client = s3_client(values["AWS_ENDPOINT_URL"], values["AWS_ACCESS_KEY_ID"],
                       values["AWS_SECRET_ACCESS_KEY"])  # fmt: skip
    images = S3Url(SCORING_BUCKET, "scoring/images")
    for path in folder.rglob("*"):
        if path.is_file():
            key = f"{images.key}/{path.relative_to(folder).as_posix()}"
            client.upload_file(str(path), images.bucket, key)
    for host in team.hosts.hosts:
        shutil.copytree(exported_model, host.project / "scoring-model")
    expected = pd.read_parquet(score(exported_model, folder, root / "here.parquet"))
    assert len(expected) == 300
    return Scoring(images, "scoring-model", expected)


def assert_scored_once(scoring: Scoring, dest: S3Url) -> None:
    """The table under ``dest`` (whole: its _SUCCESS lists its parts) is one-machine scoring's:
    every image once, the same labels, probabilities to float rounding."""
    scored = pd.concat(read_parts(dest), ignore_index=True)
    assert scored["id"].tolist() == list(range(len(scoring.expected)))  # each image once
    # The same rows; an image's path is its object's key here, its file's there.
    pd.testing.assert_frame_equal(
        scored.drop(columns="path"), scoring.expected.drop(columns="path"),
        check_exact=False, rtol=1e-5, atol=1e-6,
    )  # fmt: skip


def by_node(log: str) -> dict[str, dict[str, int]]:
    """The images each node read and scored, from the job's log ("read by node: host-a 140,
    host-b 160; scored by node: host-a 150, host-b 150")."""
    found = re.findall(r"(read|scored) by node: ([^;)\n]*)", log)
    assert len(found) == 2, log
    return {
        what: {node: int(n) for node, n in (item.split() for item in nodes.split(", "))}
        for what, nodes in found
    }


def flow_run_logs(team: Team, flow_run: str) -> str:
    """The flow run's whole log once its last line is in: a run's state turns final before
    its process's last batch of logs reaches the API, so reading at once can miss the end."""

    def read() -> list[dict]:
        logs: list[dict] = []
        with team.stack.prefect() as api:
            while page := api.post("/logs/filter", json={
                "logs": {"flow_run_id": {"any_": [flow_run]}}, "sort": "TIMESTAMP_ASC",
                "limit": 200, "offset": len(logs),
            }).raise_for_status().json():  # fmt: skip
                logs += page
        return logs

    def ended(logs: list[dict]) -> bool:
        return any(
            log["task_run_id"] is None and log["message"].startswith("Finished in state")
            for log in logs
        )

    logs = servers.wait_until(lambda: (found := read()) and ended(found) and found, 60, **LONG_WAIT)
    return "\n".join(log["message"] for log in (logs or read()))


def test_a_score_deployment_run_scores_an_s3_prefix_on_both_hosts(
    team: Team, scoring: Scoring
) -> None:
    """Issue 45: `prefect deployment run imageops-score/score -p cluster=team` on host A, as a
    person who sourced the join file: one Ray Data job whose actors score on both hosts' nodes,
    the table under the S3 prefix every image once and one machine's."""
    team.rejoin()
    dest = S3Url(SCORING_BUCKET, "scoring/by-deployment")
    flow_run = run_deployment(
        team, team.a, "imageops-score/score", model=scoring.model, images=str(scoring.images),
        dest=str(dest), cluster="team", **SCORING_OPTIONS,
    )  # fmt: skip
    state = final_state(team, flow_run, 400)
    logs = flow_run_logs(team, flow_run)
    assert state["type"] == "COMPLETED", f"{state}\n{logs}\n{team.report()}"
    assert f"on the Ray cluster at {team.cluster}" in logs
    # The job's tasks read on both hosts (Ray Data spreads them); its actors, one pinned to each
    # host from the start, none on the server's 0-CPU head (tasks/cluster/placement.py), scored
    # the images as they came (an actor still starting takes none).
    assert "2 actor(s) on 2 node(s)" in logs, logs
    nodes = by_node(logs)
    assert set(nodes["read"]) == {"host-a", "host-b"}, logs
    assert sum(nodes["read"].values()) == sum(nodes["scored"].values()) == 300, logs
    assert_scored_once(scoring, dest)


@contextlib.contextmanager
def reads_held_on_a(team: Team, trace: Path) -> Iterator[Callable[[], bool]]:
    """Host A joined again with its read tasks hanging at their first image (the fault point
    `score.image_read`, in A's Ray node only: the rows come in order, so a job cannot end without
    them), then, after the block, without it for the module's later tests. Yields the check that
    one of A's read tasks holds an image."""
    team.hosts.power_off(team.a)
    team.stack.join(team.a, IMAGEOPS_FAULT="score.image_read:hang", IMAGEOPS_FAULT_TRACE=str(trace))
    try:
        team.wait_for_nodes(2)
        yield lambda: trace.exists() and bool(faults.reached(trace, "score.image_read"))
    finally:
        team.hosts.power_off(team.a)
        team.stack.join(team.a)


def ended(host: Host, driver: subprocess.Popen) -> str:
    """What a scoring driver on ``host`` printed, once it has ended: one still running is sent
    SIGABRT (with PYTHONFAULTHANDLER=1 it prints every thread's stack), then SIGKILL. Signalled
    inside the host: nsenter, the process this one started, does not pass signals on."""
    for sig in (signal.SIGABRT, signal.SIGKILL):
        for pid in host.processes_running("app.cli score"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            driver.wait(timeout=20)
    driver.kill()
    return (driver.communicate(timeout=30)[0] or "")[-12000:]


def test_a_cli_scoring_ends_whole_when_a_host_loses_power_mid_job(
    team: Team, scoring: Scoring
) -> None:
    """Issue 45: `imageops score s3://... s3://... --cluster team` on host B; host A's read task
    holds its images (a hang armed on A's Ray node), then A loses power: its work is redone on
    B's node, the job names the node it lost, and the table is whole (_SUCCESS), every image
    once, one machine's."""
    team.rejoin()
    a, b, hosts = team.a, team.b, team.hosts
    dest = S3Url(SCORING_BUCKET, "scoring/by-cli")
    with reads_held_on_a(team, a.root / "score-trace") as held:
        options = [f"--{k.replace('_', '-')}={v}" for k, v in SCORING_OPTIONS.items()]
        command = [PY, "-m", "app.cli", "score", scoring.model, str(scoring.images), str(dest),
                   "--cluster", "team", *options]  # fmt: skip
        started = time.monotonic()
        env = b.env | team.stack.values | {"COLUMNS": "200", "PYTHONFAULTHANDLER": "1"}
        driver = subprocess.Popen(
            b.command(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        try:
            wait_for("a read task on host A", held, 300)
            assert driver.poll() is None  # the rows come in order: the job waits for A's
            hosts.power_off(a)
            printed, _ = driver.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail(f"not scored 300 s after host A lost power:\n{ended(b, driver)}")
        finally:
            ended(b, driver)  # never left running into the module's next test
        print(f"scored with a host lost in {time.monotonic() - started:.0f} s")
    assert driver.returncode == 0, printed
    # The job names the node it lost; what A held was read and scored again on B.
    (lost,) = re.findall(r"Lost node\(s\) (.*) during the job", printed)
    assert lost == f"{a.address} (host-a)", printed
    nodes = by_node(printed)  # A's read tasks, each held at its first image, ran again on B
    assert nodes["read"] == {"host-b": 300} and sum(nodes["scored"].values()) == 300, printed
    assert_scored_once(scoring, dest)


SCORING_JOB = ("_Scorer", "_read_batch")  # a scoring job's actors and read tasks (Ray workers)


def scoring_processes(hosts: Hosts) -> dict[str, list[str]]:
    """Each host's processes of a scoring job: its actors and its read tasks."""
    return {
        host.name: [f"{pid} {command[:80]}" for pid, command in
                    host.processes_running(*SCORING_JOB).items()]
        for host in hosts.hosts
    }  # fmt: skip


def test_a_cancelled_score_deployment_run_stops_every_actor_on_both_hosts_within_30_seconds(
    team: Team, scoring: Scoring
) -> None:
    """Issue 45: `prefect flow-run cancel` of a score deployment run on the team while its job
    runs (host A's read tasks held at their first image, the actors waiting on both hosts): every
    actor and read task on both hosts ends within 30 s, the run is CANCELLED, and no table looks
    whole under the prefix (no _SUCCESS)."""
    team.rejoin()
    hosts = team.hosts
    dest = S3Url(SCORING_BUCKET, "scoring/cancelled")
    with reads_held_on_a(team, team.a.root / "cancel-trace") as held:
        flow_run = run_deployment(
            team, team.b, "imageops-score/score", model=scoring.model,
            images=str(scoring.images), dest=str(dest), cluster="team", **SCORING_OPTIONS,
        )  # fmt: skip
        wait_for("a read task on host A", held, 300)
        on_both = lambda: all(scoring_processes(hosts).values())  # noqa: E731
        wait_for("the job's actors on both hosts", on_both, 120)
        cancelled = team.b.run([PY, "-m", "prefect", "flow-run", "cancel", flow_run],
                               **team.stack.values)  # fmt: skip
        assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
        started = time.monotonic()
        gone = lambda: not any(scoring_processes(hosts).values())  # noqa: E731
        if not servers.wait_until(gone, 30, **LONG_WAIT):
            left = scoring_processes(hosts)
            pytest.fail(f"the job still runs 30 s after the cancel: {left}\n{team.report()}")
        assert time.monotonic() - started < 30, scoring_processes(hosts)
        state = final_state(team, flow_run, 240)
        assert state["type"] == "CANCELLED", f"{state}\n{team.report()}"
    values = team.stack.values
    client = s3_client(values["AWS_ENDPOINT_URL"], values["AWS_ACCESS_KEY_ID"],
                       values["AWS_SECRET_ACCESS_KEY"])  # fmt: skip
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=dest.bucket, Prefix=dest.key)
            .get("Contents", [])]  # fmt: skip
    assert not [k for k in keys if k.endswith("_SUCCESS")], keys


# --- the nightly pipeline -------------------------------------------------------------------


def scheduled_run(team: Team, deployment: str, schedule: str, timeout_s: float) -> str:
    """The first flow run that Prefect's scheduler made from ``schedule`` of ``deployment``."""
    made: list[str] = []
    key = f"scheduled {deployment} {schedule} "  # Prefect's idempotency key of a scheduled run

    def scheduled() -> bool:
        with team.stack.prefect() as api:
            runs = api.post("/flow_runs/filter", json={
                "deployments": {"id": {"any_": [deployment]}}, "sort": "EXPECTED_START_TIME_ASC",
            }).raise_for_status().json()  # fmt: skip
        made[:] = [r["id"] for r in runs if (r["idempotency_key"] or "").startswith(key)]
        return bool(made)

    wait_for("the scheduler's flow run", scheduled, timeout_s)
    return made[0]


def test_the_nightly_pipeline_runs_on_the_host_that_did_not_prepare_the_data(
    team: Team, digits_raw: Path
) -> None:
    """Issue 44, finding 2: host A puts raw images in its checkout and versions them; host B,
    which never had them, runs the pipeline deployment end to end, started by Prefect's
    scheduler from a schedule of the deployment (the nightly one, as shipped, fires at 02:00)."""
    team.rejoin()
    a, b = team.a, team.b
    shutil.copytree(digits_raw, a.project / "data" / "raw" / "digits")
    printed = cli(a, "version", "data/raw/digits", **team.stack.values)
    (reference,) = re.findall(r"raw/digits@[0-9a-f]{32}(?:\.dir)?", printed)
    team.stack.leave(a)  # A's worker is gone: only B's takes the run
    shutil.rmtree(b.project / "data")  # B never had any of the data
    # A schedule that fires in 20 s, added as in the UI's schedule form, the run made tiny by
    # the schedule's parameters: a small network at 16 px, one epoch, one process, on this CPU.
    tiny = {"transform": SMALL, "model": NET,
            "train": {k: TRAIN[k] for k in TRAIN if k != "nodes"}}  # fmt: skip
    soon = datetime.now(UTC) + timedelta(seconds=20)
    with team.stack.prefect() as api:
        deployment = api.get("/deployments/name/imageops-pipeline/pipeline").json()
        (nightly,) = [s for s in deployment["schedules"] if s["slug"] == "nightly-retrain"]
        assert nightly["schedule"]["cron"] == "0 2 * * *" and not nightly["parameters"]
        added = api.post(f"/deployments/{deployment['id']}/schedules", json=[{
            "schedule": {"interval": 86400, "anchor_date": soon.isoformat(), "timezone": "UTC"},
            "active": True, "slug": "retrain-now", "parameters": {"config": tiny},
        }]).raise_for_status().json()  # fmt: skip
    flow_run = scheduled_run(team, deployment["id"], added[0]["id"], 60)
    state = final_state(team, flow_run, 600)
    assert state["type"] == "COMPLETED", f"{state}\n{team.report()}"
    client = team.mlflow
    version = client.get_model_version_by_alias(MODEL, "challenger")
    run = client.get_run(version.run_id)
    assert run.info.status == "FINISHED"
    assert version.tags["data_ref.source"] == reference  # host A's data, not another copy
    # (The registered model scored on another host from the registry: the worker-SIGKILL test.)
