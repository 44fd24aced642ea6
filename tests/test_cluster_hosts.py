"""Two hosts that share nothing but servers train one model: a Ray head on host A, a Ray worker
on host B, each in a network namespace of its own with its own code, home and data; MLflow
(artifacts in S3), SeaweedFS and Prefect in the root namespace. 2-node jobs through `prefect
deployment run` on host A's Prefect worker (killed under its flow run; the model it registers
is scored on host B), a cancelled one, and one from the CLI on host A while host B loses power.
See tests/hosts.py for what a host is.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from hosts import Host, Hosts, can_make_hosts
from mlflow import MlflowClient
from server_processes import LONG_WAIT, PROMPT_WORKER, RAY_NODE, base_env, free_port, healthy

from models.untrained import resnet, write_untrained
from tasks.data.transform import init_transformation
from tasks.shared import faults, servers
from tasks.train.loop import METRICS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(can_make_hosts() is not None, reason=str(can_make_hosts())),
]
PY = sys.executable
SMALL = {"resize_size": 16, "center_crop_size": 16, "random_horizontal_flip": False}
TRAIN = {"epochs": 1, "batch_size": 16, "learning_rate": 0.01, "nproc_per_node": 1,
         "device": "cpu", "precision": "fp32", "nodes": 2}  # fmt: skip
MODEL = "imageops-classifier"


class Team:
    """The hosts, the servers on the bridge, and a Ray cluster of host A (head) and host B."""

    def __init__(self, hosts: Hosts, root: Path) -> None:
        from tasks.shared.database_templates import seed
        from tasks.shared.object_store import ensure_bucket, start_seaweedfs

        self.hosts = hosts
        self.a, self.b = hosts.hosts
        self.deployed = False  # the work pool and the deployments, made by the first worker
        gateway = hosts.gateway
        keys = {"access_key": f"k{secrets.token_hex(4)}", "secret_key": secrets.token_hex(16)}
        self.s3 = start_seaweedfs(root / "s3", host=gateway, **keys)
        ensure_bucket(self.s3.endpoint_url, "imageops", keys["access_key"], keys["secret_key"])
        mlflow_port, prefect_port = free_port(), free_port()
        self.mlflow = f"http://{gateway}:{mlflow_port}"
        self.prefect_api = f"http://{gateway}:{prefect_port}/api"
        servers = hosts.processes
        # The databases from the migrated templates, as `imageops serve` does.
        seed("mlflow", root / "mlflow.db")
        seed("prefect", root / "prefect" / "prefect.db")
        servers.start(
            "mlflow",
            [PY, "-m", "mlflow", "server", "--host", gateway, "--port", str(mlflow_port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
             "--artifacts-destination", "s3://imageops/mlartifacts"],
            base_env() | self.s3.environment(),
        )  # fmt: skip
        servers.start(
            "prefect",
            # No UI, schedules or late-run marking: nothing here looks at them.
            [PY, "-m", "prefect", "server", "start", "--host", gateway,
             "--port", str(prefect_port), "--no-ui", "--no-scheduler", "--no-late-runs"],
            base_env() | {"PREFECT_HOME": str(root / "prefect")},
        )  # fmt: skip
        # What every machine of the team sets (the team stack's join file holds the same).
        self.env = self.s3.environment() | {
            "IMAGEOPS_MLFLOW_TRACKING_URI": self.mlflow,
            "IMAGEOPS_PREFECT_API_URL": self.prefect_api,
            "PREFECT_API_URL": self.prefect_api,
            "IMAGEOPS_DVC_REMOTE_URL": "s3://imageops/dvc",
            "IMAGEOPS_CHECKPOINT_URL": "s3://imageops/checkpoints",
        }
        for host in hosts.hosts:
            host.env |= self.env
        self.cluster = f"{self.a.address}:6379"
        self.ray_tmp: list[Path] = []
        # A node that stops answering is declared dead in about 3 s, not Ray's default 15 s+.
        quick = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                 "RAY_health_check_failure_threshold": "3"}  # fmt: skip
        self.start_ray(self.a, "--head", "--port", "6379", "--include-dashboard=false", **quick)
        servers.wait("MLflow", lambda: healthy(f"{self.mlflow}/health"), 300)
        servers.wait("Prefect", lambda: healthy(f"{self.prefect_api}/health"), 300)
        self.start_ray(self.b, "--address", self.cluster)
        self.wait_for_nodes(2)

    def wait_for_nodes(self, count: int) -> None:
        """Until the cluster counts ``count`` nodes alive (asked from host A, a node)."""
        ask = (
            "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
            "print(sum(n['Alive'] for n in ray.nodes()))"
        )

        def alive() -> bool:
            done = self.a.run([PY, "-c", ask, self.cluster], timeout_s=60)
            return done.returncode == 0 and done.stdout.strip().endswith(str(count))

        # Not Processes.wait: a host's processes that lost power are dead on purpose.
        wait_for(f"{count} Ray nodes", alive, 180)

    def start_ray(self, host: Host, *args: str, **env: str) -> None:
        """A Ray node on ``host``: the head (``--head``) or a worker joining the cluster."""
        self.ray_tmp.append(Path(tempfile.mkdtemp(prefix="ray", dir="/tmp")))
        self.hosts.start(
            host, f"ray-{len(self.ray_tmp)}",
            [str(Path(PY).with_name("ray")), "start", "--block", "--num-cpus", "1",
             "--disable-usage-stats", "--node-ip-address", host.address,
             "--temp-dir", str(self.ray_tmp[-1]), *args],
            **RAY_NODE | env,
        )  # fmt: skip

    def stop(self) -> None:
        self.hosts.processes.stop()
        self.s3.stop(timeout_s=2)
        for folder in self.ray_tmp:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def team(
    tmp_path_factory: pytest.TempPathFactory, digits_split: tuple[Path, Path]
) -> Iterator[Team]:
    root = tmp_path_factory.mktemp("team")
    with Hosts(root) as hosts:
        running = Team(hosts, root)
        try:
            for host in hosts.hosts:  # each machine has its own checkout of the project's data
                for split in digits_split:
                    shutil.copytree(split, host.project / "data" / "digits" / split.name)
            yield running
        except BaseException:
            print(hosts.processes.report())
            raise
        finally:
            running.stop()


def cli(host: Host, *args: str, timeout_s: float = 600) -> str:
    result = host.run([PY, "-m", "app.cli", *args], timeout_s=timeout_s, COLUMNS="200")
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def train_command(host: Host, cluster: str, **params: object) -> list[str]:
    """`imageops train` of a fresh resnet18 on the digits at 16 px, as typed on ``host``."""
    write_untrained(resnet("resnet18", pretrained=False), host.project / "untrained")
    init_transformation(host.project / "transform", SMALL)
    options = [f"--{k.replace('_', '-')}={v}" for k, v in (TRAIN | params).items()]
    return [PY, "-m", "app.cli", "train", "untrained", "data/digits/train", "data/digits/val",
            "model", "--cluster", cluster, "--transform", "transform", *options]  # fmt: skip


def wait_for(
    what: str,
    ready: Callable[[], object],
    timeout_s: float,
    max_interval_s: float = LONG_WAIT["max_interval_s"],
) -> None:
    """Poll ``ready`` (more slowly as the wait goes on, up to ``max_interval_s``)."""
    pacing = LONG_WAIT | {"max_interval_s": max_interval_s}
    assert servers.wait_until(ready, timeout_s, **pacing), f"timed out waiting for {what}"


def epoch_ended(trace: Path) -> bool:
    return trace.exists() and bool(faults.reached(trace, "train.epoch_end"))


def training_processes(hosts: Hosts) -> list[str]:
    """The torchrun and worker processes still alive on any host."""
    found = []
    for host in hosts.hosts:
        pids = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True,
                              text=True).stdout.split()  # fmt: skip
        for pid in pids:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "torch.distributed.run" in command or "tasks.train.worker" in command:
                found.append(f"{host.name}: {pid} {command[:80]}")
    return found


def test_a_two_node_job_from_prefect_outlives_its_worker_and_is_scored_on_the_other_host(
    team: Team,
) -> None:
    """`prefect deployment run` on host A's worker, SIGKILLed once training runs: the flow run
    goes on and ends COMPLETED, the MLflow run FINISHED; host B scores the registered model."""
    b = team.b
    worker = start_worker(team, "host-a")
    # One epoch: the worker is killed as soon as the job trains, and the flow run has the
    # export and the registration still to do after the training.
    flow_run = run_train_deployment(team, TRAIN | {"cluster": team.cluster})
    client = MlflowClient(team.mlflow, team.mlflow)
    # Promptly: the worker must die while its flow run still has work to do.
    training = lambda: training_runs(client, "RUNNING")  # noqa: E731
    wait_for("the cluster job to train", training, 300, max_interval_s=0.5)
    os.kill(worker.pid, signal.SIGKILL)  # the worker only: its flow run goes on

    state = final_state(team, flow_run, 540)
    assert state == "COMPLETED", state + team.hosts.processes.report()
    version = client.get_model_version_by_alias(MODEL, "challenger")
    run = client.get_run(version.run_id)
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"
    assert not training_runs(client, "RUNNING")
    # Host B never saw this model: it gets it from the registry (artifacts in S3) and scores.
    cli(b, "score", f"models:/{MODEL}/{version.version}", "data/digits/val", "scored.csv")
    rows = (b.project / "scored.csv").read_text().splitlines()
    assert len(rows) > 10 and rows[0].startswith("id,path,category")


def test_a_cancelled_flow_run_stops_the_cluster_job_within_30_seconds(team: Team) -> None:
    start_worker(team, "host-a-again")
    flow_run = run_train_deployment(team, TRAIN | {"cluster": team.cluster, "epochs": 50})
    wait_for("torchrun on both hosts", lambda: len(training_processes(team.hosts)) >= 4, 300)
    cancelled = team.a.run([PY, "-m", "prefect", "flow-run", "cancel", flow_run])
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    started = time.monotonic()
    wait_for("every training process to stop", lambda: not training_processes(team.hosts), 30)
    assert time.monotonic() - started < 30
    assert final_state(team, flow_run, 240) == "CANCELLED"  # the API hears it late when busy
    client = MlflowClient(team.mlflow)
    assert training_runs(client, "KILLED") and not training_runs(client, "RUNNING")


def start_worker(team: Team, name: str) -> subprocess.Popen:
    """A Prefect worker on host A's `local` pool (the pool and deployments made first, once)."""
    if not team.deployed:
        for command in (
            [PY, "-m", "prefect", "work-pool", "create", "local", "--type", "process",
             "--base-job-template", "deployments/work-pools/local.json"],
            [PY, "-m", "prefect", "work-queue", "create", "training", "--pool", "local"],
            [PY, "-m", "app.deployments"],
        ):  # fmt: skip
            done = team.a.run(command, timeout_s=180, **base_env() | team.env)
            assert done.returncode == 0, done.stdout + done.stderr
        team.deployed = True
    command = [PY, "-m", "prefect", "worker", "start", "--pool", "local", "--name", name]
    return team.hosts.start(team.a, name, command, **PROMPT_WORKER)


def run_train_deployment(team: Team, params: dict) -> str:
    """`prefect deployment run` of the train deployment from host A; the flow run's id."""
    started = team.a.run(
        [PY, "-m", "prefect", "deployment", "run", "imageops-train-model/train",
         "-p", "train_data=data/digits/train", "-p", "val_data=data/digits/val",
         "-p", f"params={json.dumps(params)}", "-p", f"transform={json.dumps(SMALL)}"],
        timeout_s=120,
    )  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    (flow_run,) = re.findall(r"UUID: ([0-9a-f-]{36})", started.stdout)
    return flow_run


def final_state(team: Team, flow_run: str, timeout_s: float) -> str:
    """The flow run's state type once final, read from the Prefect API."""
    final = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")
    seen: list[str] = ["?"]

    with httpx.Client(base_url=team.prefect_api) as api:  # one client: each costs an SSL setup

        def ended() -> bool:
            seen[0] = api.get(f"/flow_runs/{flow_run}").json()["state_type"]
            return seen[0] in final

        wait_for(f"flow run {flow_run} to end", ended, timeout_s)
    return seen[0]


def training_runs(client: MlflowClient, status: str) -> list:
    experiment = client.get_experiment_by_name("imageops")
    if experiment is None:
        return []
    return client.search_runs([experiment.experiment_id], f"attributes.status = '{status}'")


def test_a_two_node_job_from_the_cli_survives_a_host_losing_power(team: Team) -> None:
    """`imageops train --nodes 2` on host A: a rank on each host, meeting at a host's address.
    Host B loses power right after epoch 1; the job goes on from epoch 1's checkpoint (in S3)
    once B has joined again, and MLflow has every epoch once."""
    a, b, hosts = team.a, team.b, team.hosts
    trace = b.root / "fault-trace"
    hosts.power_off(b)  # B rejoins with the fault armed: its rank stops after epoch 1
    team.start_ray(
        b, "--address", team.cluster,
        IMAGEOPS_FAULT="train.epoch_end:epoch=1:stop", IMAGEOPS_FAULT_TRACE=str(trace),
    )  # fmt: skip
    team.wait_for_nodes(2)  # the dead B is no longer counted, the armed one is
    driver = subprocess.Popen(
        a.command(train_command(a, team.cluster, epochs=2)), env=a.env | {"COLUMNS": "200"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_for("host B's rank at the end of epoch 1", lambda: epoch_ended(trace), 300)
        hosts.power_off(b)
        time.sleep(2)
        team.start_ray(b, "--address", team.cluster)  # capacity is back
        printed, _ = driver.communicate(timeout=400)
    finally:
        driver.kill()
    assert driver.returncode == 0, printed
    assert "the job starts again from its last checkpoint" in printed
    (run_id,) = re.findall(r"MLflow run: (\w+)", printed)
    client = MlflowClient(team.mlflow)
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
    hosts_of_ranks = set(re.findall(ranks_on, rank_logs))
    assert hosts_of_ranks == {"host-a", "host-b"}
    meetings = set(re.findall(r"meeting at ([\d.]+):\d+ via (\w+)", rank_logs))
    assert meetings and meetings <= {(a.address, "eth0"), (b.address, "eth0")}
    # host B had no copy of the data: it got both versions from the DVC remote (S3)
    assert len(list((b.home / "data-versions").iterdir())) >= 2
