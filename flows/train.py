"""The train flow: one training job, on one node or as N node agents that meet at a rendezvous.

Composition only. One node: the train task. Many nodes: the job's MLflow run is opened once, then
one node agent per node (each its own task run, all submitted at once on the thread pool) runs
torchrun for its node against the same run, run folder and c10d rendezvous endpoint; torchrun
makes one DDP world of them. Here every agent runs on this machine (testing, or one big machine
with node-sized slices); on real machines each node runs its agent itself (see the README's
scale-out section), or, when deployed, as a flow run on a work pool.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from models.transform_spec import TransformSpec
from tasks.train.launch import (
    RDZV_TIMEOUT_S,
    TrainResult,
    local_rendezvous_endpoint,
    open_run_task,
    train_task,
)
from tasks.train.params import TrainParams

# Node agents wait for each other at the rendezvous, so each needs a thread of its own: a pool
# smaller than the job would leave the last agents queued until the others time out.
MAX_LOCAL_NODES = 16


@flow(
    name="imageops-train",
    task_runner=ThreadPoolTaskRunner(max_workers=MAX_LOCAL_NODES),
    log_prints=True,
)
def train_flow(
    model: Path,
    train_data: Path,
    val_data: Path,
    out: Path,
    params: TrainParams,
    transform: TransformSpec | Path,
    data_version: dict[str, str] | None = None,
    run_name: str | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_timeout_s: int = RDZV_TIMEOUT_S,
) -> TrainResult:
    """Train ``model`` into ``out`` with ``params.nodes`` x ``params.nproc_per_node`` processes.

    ``rdzv_endpoint`` (host:port) is where the node agents meet; default: a free port on
    127.0.0.1. ``rdzv_timeout_s``: how long an agent waits for the others before it fails with
    RendezvousTimeoutError. Returns node 0's result (all nodes share one run and one model).
    """
    if params.nodes == 1:
        return train_task(
            model, train_data, val_data, out, params,
            transform=transform, data_version=data_version, run_name=run_name,
        )  # fmt: skip
    endpoint = rdzv_endpoint or local_rendezvous_endpoint()
    run_id = open_run_task(
        model, train_data, val_data, out, params,
        transform=transform, data_version=data_version, run_name=run_name,
    )  # fmt: skip
    agents = []
    for node_rank in range(params.nodes):
        agent = train_task.with_options(task_run_name=f"train-node-{node_rank}")
        agents.append(agent.submit(
            model, train_data, val_data, out, params,
            transform=transform, data_version=data_version, run_id=run_id,
            node_rank=node_rank, rdzv_endpoint=endpoint, rdzv_timeout_s=rdzv_timeout_s,
        ))  # fmt: skip
    results = [agent.result() for agent in agents]
    return results[0]
