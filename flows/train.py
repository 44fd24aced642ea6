"""The train flow: one training job, on one node or as N node agents that meet at a rendezvous.

Composition only. One node: the train task. Many nodes: the job's MLflow run is opened once, then
one node agent per node (each its own task run, all submitted at once on the thread pool) runs
torchrun for its node against the same run, run folder and c10d rendezvous endpoint; torchrun
makes one DDP world of them. Here every agent runs on this machine (testing, or one big machine
with node-sized slices); on real machines each node runs its agent itself (see the README's
scale-out section), or, when deployed, as a flow run on a work pool.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import BaseModel, ConfigDict, Field

from flows.config import (
    DEMO_MODEL,
    DEMO_TRAIN,
    DEMO_TRANSFORM,
    DemoModel,
    DemoTrainParams,
    DemoTransform,
)
from tasks.data.versioning import version_task
from tasks.inference.export import export_task
from tasks.registry.promote import CHALLENGER
from tasks.registry.register import register_task
from tasks.shared.settings import get_settings
from tasks.shared.step import name_flow_run
from tasks.train.build_model import build_model_task
from tasks.train.launch import (
    TrainResult,
    finished_result,
    local_rendezvous_endpoint,
    open_run_task,
    train_task,
)
from tasks.train.request import TrainRequest

# Node agents wait for each other at the rendezvous, so each needs a thread of its own: a pool
# smaller than the job would leave the last agents queued until the others time out.
MAX_LOCAL_NODES = 16


@flow(
    name="imageops-train",
    task_runner=ThreadPoolTaskRunner(max_workers=MAX_LOCAL_NODES),
    log_prints=True,
)
def train_flow(request: TrainRequest, node_deployment: str | None = None) -> TrainResult:
    """Train ``request`` with ``params.nodes`` x ``params.nproc_per_node`` processes.

    ``request.rdzv_endpoint`` (host:port) is where the node agents meet; default: a free port on
    127.0.0.1. ``request.rdzv_timeout_s``: how long an agent waits for the others before it
    fails with RendezvousTimeoutError. ``node_deployment`` (``imageops-train-node/train-node``):
    each node agent is a flow run of that deployment, so the pool's workers (one per machine)
    run them. Returns node 0's result (all nodes share one run and one model).
    """
    nodes = request.params.nodes
    if nodes == 1:
        return train_task(request)
    endpoint = request.rdzv_endpoint or local_rendezvous_endpoint()
    run_id = open_run_task(request)
    job = request.model_copy(update={"run_id": run_id, "rdzv_endpoint": endpoint})
    if node_deployment:
        _run_node_deployments(node_deployment, job)
        return finished_result(run_id, request.out)
    agents = []
    for node_rank in range(nodes):
        agent = train_task.with_options(task_run_name=f"train-node-{node_rank}")
        agents.append(agent.submit(job.model_copy(update={"node_rank": node_rank})))
    results = [agent.result() for agent in agents]
    return results[0]


class TrainedModel(BaseModel):
    """What a run of the train deployment produced."""

    model_dir: Path
    mlflow_run_id: str
    metrics: dict[str, float]
    data_version: dict[str, str]
    registered_version: str | None  # None when not registered


class TrainSteps(BaseModel):
    """The train deployment's steps before and after training, each one a switch."""

    model_config = ConfigDict(extra="forbid")  # a misspelt switch is an error, not a no-op

    version_data: bool = Field(
        default=True,
        title="Version data with DVC",
        description="dvc add + push both data sets first; their md5s tag the run and model.",
    )
    register_model: bool = Field(
        default=True, title="Register", description="Export to ONNX and register as @challenger."
    )


class MultiNode(BaseModel):
    """Where the nodes of a multi-node job meet and who runs them; unused for one node."""

    model_config = ConfigDict(extra="forbid")  # a misspelt switch is an error, not a no-op

    rdzv_endpoint: str | None = Field(
        default=None,
        title="Rendezvous endpoint",
        description="host:port where the nodes of a multi-node job meet (a machine every node "
        "reaches). Empty: a free port on this machine.",
        pattern=r"^[^:\s]+:\d+$",
    )
    node_deployment: str | None = Field(
        default=None,
        title="Node deployment",
        description="imageops-train-node/train-node makes each node a flow run on the work pool "
        "(one worker per machine). Empty: all nodes run here.",
    )


EVERY_STEP = TrainSteps()
HERE = MultiNode()  # every node on this machine, meeting on a free local port


@flow(name="imageops-train-model", log_prints=True)
def train_model_flow(
    model: Annotated[DemoModel, Field(title="Model")] = DEMO_MODEL,
    train_data: Annotated[
        str,
        Field(
            title="Training data",
            description="Labeled ImageDirectory, relative to the project root.",
            min_length=1,
        ),
    ] = "data/digits/train",
    val_data: Annotated[
        str,
        Field(
            title="Validation data",
            description="Labeled ImageDirectory scored after every epoch (the best epoch wins).",
            min_length=1,
        ),
    ] = "data/digits/val",
    params: Annotated[DemoTrainParams, Field(title="Training parameters")] = DEMO_TRAIN,
    transform: Annotated[
        DemoTransform | None,
        Field(
            title="Image transformation",
            description="Init Image Transformation; the default fits the 32x32 digits demo. "
            "Empty (null): the transform the data was prepared with (Apply Image "
            "Transformation), else Init Image Transformation's defaults (224 px). Data prepared "
            "with another transform is refused.",
        ),
    ] = DEMO_TRANSFORM,
    steps: Annotated[TrainSteps, Field(title="Steps around training")] = EVERY_STEP,
    multi_node: Annotated[MultiNode, Field(title="Multi-node job (params.nodes > 1)")] = HERE,
) -> TrainedModel:
    """Train one model from the UI or a schedule: build, train (DDP), export, register."""
    settings = get_settings()
    root = settings.project_root
    name_flow_run(f"train-{model.name}")
    data_version: dict[str, str] = {}
    if steps.version_data:
        data_version = {name: version_task(root / path) for name, path in
                        (("train", train_data), ("val", val_data))}  # fmt: skip
        name_flow_run(f"train-{model.name}-data-{data_version['train'][:8]}")
    out = settings.home_dir / "outputs" / datetime.now(UTC).strftime("train-%Y%m%d-%H%M%S")
    request = TrainRequest(
        model=out / "untrained", train_data=root / train_data, val_data=root / val_data,
        out=out / "model", params=params, transform=transform, data_version=data_version,
        rdzv_endpoint=multi_node.rdzv_endpoint,
    )  # fmt: skip
    build_model_task(model, request.model)
    trained = train_flow(request, node_deployment=multi_node.node_deployment)
    version = None
    if steps.register_model:
        export_task(trained.model_dir, sample=root / val_data)
        registered = register_task(trained.model_dir, data_version=data_version, alias=CHALLENGER)
        version = str(registered.version)
    return TrainedModel(
        model_dir=trained.model_dir,
        mlflow_run_id=trained.run_id,
        metrics=trained.metrics,
        data_version=data_version,
        registered_version=version,
    )


def _run_node_deployments(deployment: str, job: TrainRequest) -> None:
    """One flow run of ``deployment`` per node, all at once; raise if any did not complete."""
    from concurrent.futures import ThreadPoolExecutor

    from prefect.deployments import run_deployment

    from tasks.shared.errors import TrainingFailedError

    nodes = job.params.nodes

    def agent(node_rank: int) -> str | None:
        run = run_deployment(
            deployment,
            parameters={
                "request": job.model_copy(update={"node_rank": node_rank}).model_dump(mode="json")
            },
            timeout=None,  # as long as the training takes
            flow_run_name=f"train-node-{node_rank}-of-{nodes}",
        )
        if run.state is not None and run.state.is_completed():
            return None
        state = run.state.type.value if run.state else "unknown"
        return f"node {node_rank} ({run.name}): {state} {run.state.message if run.state else ''}"

    with ThreadPoolExecutor(max_workers=nodes) as pool:
        failed = [f for f in pool.map(agent, range(nodes)) if f]
    if failed:
        raise TrainingFailedError(
            f"Node agents of run {job.run_id} did not complete: {'; '.join(failed)}.",
            "Open the failed flow runs in the Prefect UI: each has its node's torchrun log.",
        )


@flow(name="imageops-train-node", log_prints=True)
def train_node_flow(request: TrainRequest) -> TrainResult:
    """One node of a multi-node job: torchrun for this node, against the job's MLflow run.

    Started by the train flow (``multi_node.node_deployment``) once per node, or by hand from the
    UI with each node rank; paths are on storage every node shares, relative paths taken under
    the project root.
    """
    name_flow_run(f"train-node-{request.node_rank}-of-{request.params.nodes}")
    return train_task(request.under(get_settings().project_root))
