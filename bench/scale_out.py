"""Scale-out: a Ray cluster job against torchrun on one machine, and two hosts against one.

Usage: ``python -m bench.scale_out [--full] [--json PATH]``

The demo's training (the digits at 32 px, resnet18 from scratch, batch 16, 5 epochs) through the
CLI, with MLflow on a server and DVC and checkpoints on S3 (SeaweedFS), as a team runs it:

- **one machine**: ``imageops train`` (torchrun, 2 processes) against ``imageops train --cluster``
  on a one-node Ray cluster of the same machine (1 node x 2 processes), wall time end to end,
  alternating which goes first; goal: the cluster path at most 1.15x torchrun's time;
- **two hosts** (as root): two network namespaces that share nothing but the servers (the test
  suite's hosts, tests/hosts.py), a Ray node on each, 2 nodes x 1 process, against one of them
  alone with 2 processes: the job's images/s in its last epoch; efficiency = two hosts / one
  host, on the same two cores.
"""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/scale_out.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import ROOT, Section, Stat, Table, run_main

sys.path.insert(0, str(ROOT / "tests"))  # the namespace hosts of the test suite

GOAL = 1.15  # cluster / torchrun on one machine, the goal
EPOCHS = 5  # the demo's (params.yaml): a job as `imageops run` trains it
PY = sys.executable
RAY = str(Path(PY).with_name("ray"))


def _train(project: Path, run, epochs: int, *options: str) -> tuple[float, str]:  # type: ignore[no-untyped-def]
    """One ``imageops train`` of the demo in ``project``, run by ``run(command)``; (seconds,
    MLflow run id)."""
    from models.untrained import resnet, write_untrained
    from tasks.data.transform import init_transformation

    if not (project / "untrained").exists():
        write_untrained(resnet("resnet18", pretrained=False), project / "untrained")
        init_transformation(project / "transform", {"resize_size": 32, "center_crop_size": 32,
                                                    "random_horizontal_flip": False})  # fmt: skip
    command = [PY, "-m", "app.cli", "train", "untrained", "data/digits/train", "data/digits/val",
               "model", "--transform", "transform", f"--epochs={epochs}", "--device=cpu",
               "--precision=fp32", *options]  # fmt: skip
    began = time.perf_counter()
    done = run(command)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    (run_id,) = re.findall(r"MLflow run: (\w+)", done.stdout)
    return seconds, run_id


def _images_per_sec(tracking: str, run_id: str) -> float:
    from mlflow import MlflowClient

    history = MlflowClient(tracking).get_metric_history(run_id, "train/images_per_sec")
    return max(history, key=lambda m: m.step).value  # the last epoch: past the start-up


def _digits(project: Path) -> None:
    from tasks.data.convert import convert
    from tasks.data.sample import write_digits
    from tasks.data.split import split

    raw = project / "raw"
    write_digits(raw)
    convert(raw, project / "data" / "digits" / "images")
    data = project / "data" / "digits"
    split(data / "images", data / "train", data / "val", fraction=0.9, seed=1)
    shutil.rmtree(data / "images")
    shutil.rmtree(raw)


def run(full: bool, work: Path) -> Section:
    from hosts import Hosts, can_make_hosts
    from server_processes import Processes, base_env, free_port, healthy

    from tasks.shared.object_store import ensure_bucket, start_seaweedfs

    epochs, repeats = EPOCHS, (3 if full else 2)
    why_not = can_make_hosts()
    hosts = Hosts(work / "hosts") if why_not is None else None
    if hosts is not None:
        hosts.__enter__()
    servers = hosts.processes if hosts else Processes(work / "logs")
    address = hosts.gateway if hosts else "127.0.0.1"
    keys = {"access_key": f"k{secrets.token_hex(4)}", "secret_key": secrets.token_hex(16)}
    s3 = start_seaweedfs(work / "s3", host=address, **keys)
    ray_tmp: list[Path] = []
    try:
        ensure_bucket(s3.endpoint_url, "imageops", keys["access_key"], keys["secret_key"])
        port = free_port()
        tracking = f"http://{address}:{port}"
        servers.start(
            "mlflow",
            [PY, "-m", "mlflow", "server", "--host", address, "--port", str(port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{work / 'mlflow.db'}",
             "--artifacts-destination", "s3://imageops/mlartifacts"],
            base_env() | s3.environment(),
        )  # fmt: skip
        servers.wait("MLflow", lambda: healthy(f"{tracking}/health"), 180)
        team = s3.environment() | {
            "IMAGEOPS_MLFLOW_TRACKING_URI": tracking,
            "IMAGEOPS_DVC_REMOTE_URL": "s3://imageops/dvc",
            "IMAGEOPS_CHECKPOINT_URL": "s3://imageops/checkpoints",
            "RAY_USAGE_STATS_ENABLED": "0",
        }

        def ray_node(name: str, cpus: int, *args: str, host: object = None) -> None:
            ray_tmp.append(Path(tempfile.mkdtemp(prefix="ray", dir="/tmp")))
            command = [RAY, "start", "--block", "--num-cpus", str(cpus),
                       "--disable-usage-stats", "--temp-dir", str(ray_tmp[-1]), *args]  # fmt: skip
            if "--head" in args:  # a joining node that names it does not start (Ray's rule)
                command.append("--include-dashboard=false")
            if host is None:
                servers.start(
                    name, command, base_env() | team | {"IMAGEOPS_HOME": str(work / name)}
                )
            else:
                hosts.start(host, name, command)  # type: ignore[union-attr]

        # One machine: torchrun against a one-node cluster of this machine.
        local = work / "local"
        local.mkdir()
        _digits(local)
        env = base_env() | team | {"IMAGEOPS_PROJECT_ROOT": str(local),
                                   "IMAGEOPS_HOME": str(local / ".imageops")}  # fmt: skip

        def here(command: list[str]) -> subprocess.CompletedProcess:
            return subprocess.run(command, cwd=local, env=env, capture_output=True, text=True)

        head = f"127.0.0.1:{free_port()}"
        ray_node("ray-local", 2, "--head", "--port", head.rsplit(":", 1)[1],
                 "--node-ip-address", "127.0.0.1")  # fmt: skip
        times: dict[str, list[float]] = {"torchrun": [], "cluster": []}
        _train(local, here, 1, "--nproc-per-node=2")  # warm: caches filled
        # The node's first job fetches the data versions from S3 (once per node and version).
        first = _train(local, here, 1, "--nproc-per-node=2", "--cluster", head)[0]
        for round_ in range(repeats):
            order = ("torchrun", "cluster") if round_ % 2 == 0 else ("cluster", "torchrun")
            for side in order:
                options = ["--nproc-per-node=2"] + (
                    ["--cluster", head] if side == "cluster" else []
                )
                times[side].append(_train(local, here, epochs, *options)[0])
        ratio = Stat([c / t for c, t in zip(times["cluster"], times["torchrun"], strict=True)], "x")
        rows: list[list] = [
            ["torchrun (2 processes)", Stat(times["torchrun"], "s"), ""],
            ["Ray cluster of this machine (1 node x 2 processes)", Stat(times["cluster"], "s"),
             ratio],
        ]  # fmt: skip
        verdict = "met" if ratio.median <= GOAL else "NOT MET"
        text = [
            f"The digits (1,797 images at 32 px), resnet18 from scratch, batch 16, {epochs} "
            f"epochs, CPU, fp32; MLflow on a server, DVC and checkpoints on S3 (SeaweedFS). "
            f"**Goal: the cluster path at most {GOAL}x torchrun's time on one machine: "
            f"{verdict}** ({ratio.format()}). Both warm: the cluster node's first job, which "
            f"fetched both data versions from S3 into the node's cache, took {first:.1f} s for "
            "one epoch, before these.",
        ]
        tables = [Table(["one machine", "wall time", "cluster / torchrun"], rows)]
        if hosts is not None:
            tables.append(_two_hosts(hosts, team, tracking, epochs, ray_node))
            text.append(
                "Two hosts: two network namespaces on a bridge, each with its own code, home and "
                "Ray node (1 CPU each), sharing nothing but the servers; one host: host A alone "
                "with 2 torchrun processes. Both on the same two cores: the efficiency is what "
                "crossing hosts (veth, gloo over TCP, the cluster's placement) costs."
            )
        else:
            text.append(f"Two hosts: not measured ({why_not}).")
        return Section(
            key="scale_out",
            title="Scale-out: the Ray cluster path, and two hosts against one",
            command=f"python -m bench.scale_out{' --full' if full else ''}",
            text=text,
            tables=tables,
        )
    finally:
        servers.stop()
        s3.stop(timeout_s=2)
        if hosts is not None:
            hosts.__exit__(None, None, None)
        for folder in ray_tmp:
            shutil.rmtree(folder, ignore_errors=True)


def wait_for_nodes(hosts, a, count: int, timeout_s: float = 180) -> None:  # type: ignore[no-untyped-def]
    """Until the cluster whose head is on host ``a`` (port 6379) counts ``count`` nodes alive,
    asked from there; else the nodes' logs."""
    ask = (
        "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
        "print(sum(n['Alive'] for n in ray.nodes()))"
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = a.run([PY, "-c", ask, f"{a.address}:6379"], 60)
        if done.returncode == 0 and done.stdout.strip().endswith(str(count)):
            return
        time.sleep(2)
    raise RuntimeError(
        f"{count} Ray nodes not alive in {timeout_s:.0f} s\n{hosts.processes.report()}"
    )


def _two_hosts(hosts, team: dict[str, str], tracking: str, epochs: int, ray_node) -> Table:  # type: ignore[no-untyped-def]
    a, b = hosts.hosts
    for host in (a, b):
        host.env |= team
    _digits(a.project)
    ray_node("ray-a", 1, "--head", "--port", "6379", "--node-ip-address", a.address, host=a)
    ray_node("ray-b", 1, "--address", f"{a.address}:6379", "--node-ip-address", b.address, host=b)
    wait_for_nodes(hosts, a, 2)

    def on_a(epochs: int, *options: str) -> float:
        _, run_id = _train(a.project, lambda command: a.run(command, 1800), epochs, *options)
        return _images_per_sec(tracking, run_id)

    on_a(1, "--nproc-per-node=2")  # warm: data versioned, caches filled
    one = on_a(epochs, "--nproc-per-node=2")
    two = on_a(epochs, "--nodes=2", "--nproc-per-node=1", "--cluster", f"{a.address}:6379")
    return Table(
        ["two hosts", "images/s (last epoch)", "efficiency"],
        [
            ["one host, 2 processes (torchrun)", one, ""],
            ["two hosts, 1 process each (Ray cluster)", two, f"{two / one:.2f}"],
        ],
    )


if __name__ == "__main__":
    sys.exit(run_main(run, __doc__.split("\n\n")[0]))
