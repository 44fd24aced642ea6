"""One node of a cluster job: a Ray actor on its machine that runs torchrun for the node.

The machine shares nothing with the others but the servers: the actor gets the data set versions
the run names from the DVC remote into its own cache, the last checkpoint from the checkpoint
store, writes the run's config with its own paths, and runs the same torchrun worker as one
machine does. What rank 0 wrote (the model, the result, the curves) and every rank's log go back
to the driver as the call's value. Details: docs/training.md#cluster-jobs.
"""

from __future__ import annotations

import contextlib
import importlib
import ipaddress
import os
import socket
import threading
from pathlib import Path
from typing import Any

import psutil
from pydantic import BaseModel, ConfigDict

from models.atomic import write_json
from models.untrained import MODEL_JSON
from tasks.cluster.node_settings import node_settings
from tasks.shared.errors import ImageOpsError, InvalidDatasetError
from tasks.shared.log_tail import read_from
from tasks.train.failure import clear_failures
from tasks.train.params import RunConfig, manifest_fingerprint
from tasks.train.rendezvous import RDZV_TIMEOUT_MARK, rendezvous_timeout
from tasks.train.request import CONFIG, TrainRequest
from tasks.train.run_folder import BEST_WEIGHTS, CHECKPOINT, RESULT, rank_of, torchrun_log
from tasks.train.torchrun import (
    TORCHRUN_LOG,
    NodePlace,
    run_torchrun,
    torchrun_command,
    torchrun_environment,
    torchrun_failure,
)

# What a node keeps to itself: its resume state and its bookkeeping.
_NOT_SENT = {CHECKPOINT, BEST_WEIGHTS, CONFIG, "launch.lock"}


class NodeJob(BaseModel):
    """What the driver sends every node: the run's config (the driver's paths) and the job."""

    model_config = ConfigDict(frozen=True)

    request: TrainRequest
    config: RunConfig  # bound to the run; each node replaces the paths with its own
    untrained: dict[str, Any]  # the UntrainedModelDirectory's model.json
    data_md5: dict[str, str]  # "train" / "val": the DVC versions every node gets


class NodeInfo(BaseModel):
    """Where a node is, as its peers reach it."""

    hostname: str
    node_id: str  # the Ray node's id: a machine that rejoins is another node
    address: str  # the Ray node's address: what the other nodes dial
    port: int  # free on that address now: node 0's rendezvous store takes it
    gpus: int


class NodeOutcome(BaseModel):
    """What one node's torchrun left: every run-folder file worth keeping, as bytes."""

    node_rank: int
    address: str
    files: dict[str, bytes]  # run-folder files ("model/<name>" for the ModelDirectory)
    lead: bool  # this node ran global rank 0: the result and the model are among the files


class NodeAgent:
    """A Ray actor (see :func:`tasks.train.cluster.agent_class`), one per node of the job.

    Its settings are its machine's own (``IMAGEOPS_HOME``, credentials), with the servers the
    driver names: tracking, registry, DVC remote, checkpoint store.
    """

    def __init__(self, servers: dict[str, str], decides_precision: bool = False) -> None:
        self.settings = node_settings(servers)
        if decides_precision:
            # Deciding "auto" precision needs torch (seconds to import): imported while the
            # driver versions the data, not after (Python's import lock makes prepare wait).
            threading.Thread(
                target=importlib.import_module,
                args=("tasks.train.precision",),
                name="import-torch",
                daemon=True,
            ).start()
        self.node_rank = -1
        self.paths: dict[str, Path] = {}

    def ping(self) -> bool:
        """Answer the driver: this agent is alive and not stuck (tasks.cluster.health)."""
        return True

    def where(self) -> NodeInfo:
        import ray

        address = ray.util.get_node_ip_address()
        with socket.socket(_family(address), socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
            port = probe.getsockname()[1]
        gpus = len(ray.get_gpu_ids())  # the GPUs the placement gave this node (torch not needed)
        node_id = ray.get_runtime_context().get_node_id()
        return NodeInfo(
            hostname=socket.gethostname(), node_id=node_id, address=address, port=port, gpus=gpus
        )

    def prepare(self, job: NodeJob, node_rank: int) -> str | None:
        """Get the data and the untrained model here; node 0 decides "auto" precision."""
        from tasks.data.transform import input_size
        from tasks.data.versioning import fetch_version

        self.node_rank = node_rank
        # Before the run exists (its precision is decided here): the folder is the job's.
        home = self.settings.home_dir / "cluster" / job.config.job_key()[:16]
        self.paths = {
            name: fetch_version(job.data_md5[name], self.settings) for name in ("train", "val")
        }
        for name, path in self.paths.items():
            if manifest_fingerprint(path) != job.config.data_fingerprint[name]:
                raise InvalidDatasetError(
                    f"Node {node_rank} ({socket.gethostname()}) got version "
                    f"{job.data_md5[name]} of the {name} data, whose manifest differs from the "
                    "one the run was checked against.",
                    "Version the data again (imageops version) and start the job again.",
                )
        write_json(home / "untrained" / MODEL_JSON, job.untrained)
        self.paths["untrained"] = home / "untrained"
        self.paths["out"] = home / "model"
        config = job.config
        if node_rank != 0:
            return None
        if config.params.precision == "fp32":
            return "fp32"  # nothing to decide
        from tasks.train.precision import resolve_precision

        size = input_size(config.transform)
        return resolve_precision(config.params.precision, config.device, size)

    def train(self, job: NodeJob, place: NodePlace) -> NodeOutcome:
        """torchrun for this node; raises the worker's own error when it fails."""
        from tasks.train.checkpoint_store import download_checkpoint

        settings, rank = self.settings, place.node_rank
        run_id = str(job.config.mlflow_run_id)
        run_dir = settings.runs_dir / run_id
        config = job.config.model_copy(
            update={
                "train_data": self.paths["train"],
                "val_data": self.paths["val"],
                "out": self.paths["out"],
                "run_dir": run_dir,
            }
        )
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path = config.save(run_dir / CONFIG)
        clear_failures(run_dir)
        (run_dir / RESULT).unlink(missing_ok=True)
        # The last epoch's state, wherever it was trained: every node resumes from the same one.
        download_checkpoint(run_id, run_dir / CHECKPOINT, settings)
        download_checkpoint(run_id, run_dir / BEST_WEIGHTS, settings)
        env = torchrun_environment(
            settings, run_id, {**_thread_env(), **_interface_env(place.address, job)}
        )
        command = torchrun_command(job.request, config_path, run_id, place)
        before = _file_states(run_dir)
        launch_log = run_dir / TORCHRUN_LOG  # until the launch tells which ranks it ran
        launch_log.unlink(missing_ok=True)
        try:
            returncode = run_torchrun(
                command, env, run_dir, job.request.timeout_s, log_name=launch_log.name
            )
        finally:
            log, output = _log_by_ranks(run_dir, launch_log, before)
        if returncode != 0:
            if RDZV_TIMEOUT_MARK in output:
                where = f"node {rank} ({place.address}, {socket.gethostname()})"
                params = job.request.params
                raise rendezvous_timeout(
                    run_id, place.endpoint, where, params.nodes, place.timeout_s
                )
            raise _named(torchrun_failure(run_dir, returncode, log, output), place)
        return NodeOutcome(
            node_rank=rank,
            address=place.address,
            files=_kept_files(run_dir, self.paths["out"], _written(run_dir, before)),
            lead=(run_dir / RESULT).is_file(),
        )


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET


def _thread_env() -> dict[str, str]:
    """One compute thread per training process: the CPU the placement reserved for each.

    Ray sets OMP_NUM_THREADS in the actor to the actor's CPUs (nproc_per_node), and torchrun
    passes it on to each of the nproc_per_node processes: nproc squared threads on nproc cores,
    whose spinning made a 2-process node 7x slower per step (measured: bench.scale_out). A
    value in the request's env still wins (it comes later).
    """
    return {"OMP_NUM_THREADS": "1"}


def _interface_env(address: str, job: NodeJob) -> dict[str, str]:
    """gloo and NCCL on the interface that holds the node's address, unless the user chose.

    Left alone, gloo takes the address the hostname resolves to, often 127.0.0.1: the peers
    would dial their own loopback.
    """
    env = dict(job.request.env)
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                if variable not in os.environ and variable not in env:
                    env[variable] = name
            break
    return env


def _named(error: ImageOpsError, place: NodePlace) -> ImageOpsError:
    """The worker's error, saying which node it came from."""
    with contextlib.suppress(AttributeError):
        error.message = f"Node {place.node_rank} ({place.address}, {socket.gethostname()}): " + (
            error.message
        )
    return error


def _file_states(run_dir: Path) -> dict[str, tuple[int, int, int]]:
    """Each file of the run folder's (inode, size, modification time): what a launch changes."""
    states = {}
    for path in run_dir.iterdir():
        with contextlib.suppress(OSError):
            stat = path.stat()
            states[path.name] = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    return states


def _written(run_dir: Path, before: dict[str, tuple[int, int, int]]) -> set[str]:
    """The run folder's files made or changed since ``before``: this launch's."""
    return {name for name, state in _file_states(run_dir).items() if before.get(name) != state}


def _log_by_ranks(
    run_dir: Path, launch_log: Path, before: dict[str, tuple[int, int, int]]
) -> tuple[Path, str]:
    """Append this launch's torchrun output to the log named by the ranks it ran; (log, output).

    The ranks are those whose rank logs the launch wrote: c10d numbers the nodes itself, so the
    gang's index says nothing about them. The file keeps every launch that ran these ranks here.
    """
    ranks = [r for name in _written(run_dir, before) if (r := rank_of(Path(name))) is not None]
    output = read_from(launch_log, 0)
    log = torchrun_log(run_dir, ranks)
    with open(log, "a", encoding="utf-8") as sink:
        sink.write(output)
    launch_log.unlink(missing_ok=True)
    return log, output


def _kept_files(run_dir: Path, out: Path, written: set[str]) -> dict[str, bytes]:
    """This launch's logs and rank 0's outputs, and the ModelDirectory under ``model/``.

    Only what this launch wrote: a file left by an earlier gang, in which this machine ran other
    ranks, bears the name of a file another node sends now, and would overwrite it in the driver's
    run folder.
    """
    files = {
        name: (run_dir / name).read_bytes()
        for name in sorted(written)
        if (run_dir / name).is_file() and name not in _NOT_SENT and not name.endswith(".tmp")
    }
    if (run_dir / RESULT).is_file() and out.is_dir():
        files |= {f"model/{p.name}": p.read_bytes() for p in out.iterdir() if p.is_file()}
    return files
