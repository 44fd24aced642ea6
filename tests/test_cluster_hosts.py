"""Two hosts that share nothing but servers train one model: a Ray head on host A, a Ray worker
on host B, each in a network namespace of its own with its own code, home and data; MLflow
(artifacts in S3), SeaweedFS and Prefect in the root namespace. A 2-node job from the CLI on host
B, then one through `prefect deployment run` on host A's Prefect worker; the model it registers
is scored on host B. See tests/hosts.py for what a host is.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hosts import Host, Hosts, can_make_hosts
from mlflow import MlflowClient
from server_processes import base_env, free_port, healthy

from models.untrained import resnet, write_untrained
from tasks.data.transform import init_transformation

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
        from tasks.shared.object_store import ensure_bucket, start_seaweedfs

        self.hosts = hosts
        self.a, self.b = hosts.hosts
        gateway = hosts.gateway
        keys = {"access_key": f"k{secrets.token_hex(4)}", "secret_key": secrets.token_hex(16)}
        self.s3 = start_seaweedfs(root / "s3", host=gateway, **keys)
        ensure_bucket(self.s3.endpoint_url, "imageops", keys["access_key"], keys["secret_key"])
        mlflow_port, prefect_port = free_port(), free_port()
        self.mlflow = f"http://{gateway}:{mlflow_port}"
        self.prefect_api = f"http://{gateway}:{prefect_port}/api"
        servers = hosts.processes
        servers.start(
            "mlflow",
            [PY, "-m", "mlflow", "server", "--host", gateway, "--port", str(mlflow_port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
             "--artifacts-destination", "s3://imageops/mlartifacts"],
            base_env() | self.s3.environment(),
        )  # fmt: skip
        servers.start(
            "prefect",
            [PY, "-m", "prefect", "server", "start", "--host", gateway,
             "--port", str(prefect_port)],
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
        self.ray_tmp = [Path(tempfile.mkdtemp(prefix="ray", dir="/tmp")) for _ in range(2)]
        ray = [str(Path(PY).with_name("ray")), "start", "--block", "--num-cpus", "1",
               "--disable-usage-stats"]  # fmt: skip
        hosts.start(
            self.a, "ray-head",
            [*ray, "--head", "--port", "6379", "--node-ip-address", self.a.address,
             "--include-dashboard=false", "--temp-dir", str(self.ray_tmp[0])],
        )  # fmt: skip
        servers.wait("MLflow", lambda: healthy(f"{self.mlflow}/health"), 120)
        servers.wait("Prefect", lambda: healthy(f"{self.prefect_api}/health"), 120)
        hosts.start(
            self.b, "ray-worker",
            [*ray, "--address", self.cluster, "--node-ip-address", self.b.address,
             "--temp-dir", str(self.ray_tmp[1])],
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


def test_a_two_node_job_from_the_cli_runs_one_rank_on_each_host(team: Team) -> None:
    b = team.b
    write_untrained(resnet("resnet18", pretrained=False), b.project / "untrained")
    init_transformation(b.project / "transform", SMALL)
    options = [f"--{k.replace('_', '-')}={v}" for k, v in TRAIN.items()]
    printed = cli(
        b, "train", "untrained", "data/digits/train", "data/digits/val", "model",
        "--cluster", team.cluster, "--transform", "transform", *options,
    )  # fmt: skip
    (run_id,) = re.findall(r"MLflow run: (\w+)", printed)
    client = MlflowClient(team.mlflow)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["world_size"] == "2"
    assert (b.project / "model" / "model.safetensors").is_file()
    logs = client.download_artifacts(run_id, "logs", str(b.root / "logs"))
    ranks = set()
    for rank in (0, 1):
        text = (Path(logs) / f"rank_{rank}.log").read_text()
        ranks |= set(re.findall(r"rank (\d) of 2 on cpu on host ([^,\s]+)", text))
    assert {host for _, host in ranks} == {"host-a", "host-b"}  # one node's processes per host
    # The ranks met at a host's address on its own interface, never at loopback.
    ranks_logs = "".join(p.read_text() for p in Path(logs).glob("rank_*.log"))
    meetings = set(re.findall(r"meeting at ([\d.]+):\d+ via (\w+)", ranks_logs))
    assert len(meetings) == 1 and meetings <= {(team.a.address, "eth0"), (team.b.address, "eth0")}
    # host A had no copy: it got the data from the DVC remote (S3) into its own home
    assert any((team.a.home / "data-versions").iterdir())


def test_a_two_node_job_from_prefect_is_registered_and_scored_on_the_other_host(
    team: Team,
) -> None:
    a, b = team.a, team.b
    root_env = base_env() | team.env
    for command in (
        [PY, "-m", "prefect", "work-pool", "create", "local", "--type", "process",
         "--base-job-template", "deployments/work-pools/local.json"],
        [PY, "-m", "prefect", "work-queue", "create", "training", "--pool", "local"],
        [PY, "-m", "app.deployments"],
    ):  # fmt: skip
        done = a.run(command, timeout_s=180, **root_env)
        assert done.returncode == 0, done.stdout + done.stderr
    team.hosts.start(a, "prefect-worker", [PY, "-m", "prefect", "worker", "start", "--pool",
                     "local", "--name", "host-a"])  # fmt: skip
    params = TRAIN | {"cluster": team.cluster}
    started = a.run(
        [PY, "-m", "prefect", "deployment", "run", "imageops-train-model/train",
         "-p", "train_data=data/digits/train", "-p", "val_data=data/digits/val",
         "-p", f"params={json.dumps(params)}", "-p", f"transform={json.dumps(SMALL)}",
         "--watch", "--watch-timeout", "540"],
        timeout_s=600,
    )  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr + team.hosts.processes.report()
    assert "Completed" in started.stdout

    client = MlflowClient(team.mlflow, team.mlflow)
    version = client.get_model_version_by_alias(MODEL, "challenger")
    run = client.get_run(version.run_id)
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"
    # Host B never saw this model: it gets it from the registry (artifacts in S3) and scores.
    cli(b, "score", f"models:/{MODEL}/{version.version}", "data/digits/val", "scored.csv")
    rows = (b.project / "scored.csv").read_text().splitlines()
    assert len(rows) > 10 and rows[0].startswith("id,path,category")
