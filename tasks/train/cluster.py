"""Training on a Ray cluster: N nodes x P processes as one gang, one node's processes per machine.

The driver (this process, wherever the flow or the CLI runs) connects to the cluster, asks for a
placement group of N bundles with ``STRICT_SPREAD`` (no two nodes on one machine), starts one
:class:`~tasks.train.cluster_node.NodeAgent` in each, and runs the same torchrun worker on every
node against one MLflow run. The cluster places the gang, the driver restarts it whole from the
last checkpoint in the checkpoint store when a node is lost (dead, or not answering: see
:mod:`tasks.cluster.health`; when it is the driver's own, it joins the cluster again first),
and cancels it whole (an interrupt, or the driver's death: Ray ends the actors of a dead driver,
torchrun dies with its actor). Every wait has a deadline.
Why a placement group and not Ray Train: docs/training.md#cluster-jobs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlflow import MlflowClient

from models.atomic import atomic_directory, write_bytes
from models.untrained import MODEL_JSON
from tasks.cluster.connect import connect, reconnect
from tasks.cluster.health import DriverNodeLost, GangWatch, NodeLost, wait_refs
from tasks.cluster.job import JobParts, stopped_whole
from tasks.cluster.node_settings import server_settings
from tasks.shared.errors import ClusterUnavailableError, ImageOpsError, InvalidParameterError
from tasks.shared.settings import Settings, redact_uri
from tasks.shared.step import step_logger
from tasks.shared.tracking import configure_mlflow
from tasks.train.cluster_node import NodeAgent, NodeInfo, NodeJob, NodeOutcome
from tasks.train.mlflow_run import ending_run, publish_report, require_run, resume_or_create_run
from tasks.train.params import RunConfig
from tasks.train.request import Request, TrainRequest, check_request
from tasks.train.retention import discard_checkpoints
from tasks.train.run_folder import RESULT
from tasks.train.torchrun import NodePlace

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

POLL_S = 0.5
# How long a node's failure waits for the cluster to say whether another node died (Ray's
# health checks take about 15 s to declare a silent node dead).
LOSS_GRACE_S = 45.0
# Once placed, how long the node agents may take to start (a process, its imports) at least.
AGENT_START_S = 120.0
# How long the nodes may take to get the data versions and the model ready (a large data set from
# the DVC remote): they answer their pings meanwhile, this bounds a fetch that never ends.
PREPARE_TIMEOUT_S = 3600.0


def train_on_cluster(request: TrainRequest, settings: Settings) -> tuple[str, Path, dict]:
    """Train ``request`` on the cluster ``params.cluster``; (run id, run folder, result).

    The run folder here receives what the nodes sent back (logs, curves, result) and
    ``request.out`` the ModelDirectory, so the launcher finishes the run as on one machine.
    """
    log = step_logger(__name__)
    params = request.params
    _require_servers(settings)
    connect(str(params.cluster), params.cluster_timeout_s, log)
    device = _cluster_device(request)
    checked = check_request(request, settings, device=device)  # bad data: refused here
    experiment_id = configure_mlflow(settings)
    client = MlflowClient(settings.tracking_uri, settings.registry_uri)
    if request.run_id is not None:
        require_run(client, request.run_id)
    run = _Run(client, experiment_id, settings, request)
    with (
        _versioned_in_background(checked, request, settings) as pending,
        ending_run(client, lambda: (run.id, run.dir)) as outcome,
    ):
        with stopped_whole():
            outcomes = _run_gang(pending, run, settings, log)
        outcome.result = result = _unpack(outcomes, run.dir, request.out)
    # MLflow has the run FINISHED: the copies in the checkpoint store are dead weight now.
    discard_checkpoints(run.id, run.dir, settings)
    publish_report(run.id, run.dir, result, settings)
    return run.id, run.dir, result


class _PendingJob:
    """The job the nodes get, ready once the driver has versioned the data.

    Versioning (``dvc add`` + ``dvc push`` of unchanged data still hashes and asks the remote)
    takes seconds, and so do placing the gang and starting its actors: the two overlap
    (measured: bench.scale_out, docs/benchmarks.md).
    """

    def __init__(
        self, versions: Future[dict[str, str]], checked: Request, request: TrainRequest
    ) -> None:
        self._versions, self._checked, self._request = versions, checked, request
        self._ready: tuple[NodeJob, Request] | None = None

    def get(self) -> tuple[NodeJob, Request]:
        """The job and its checked request with the data versions; waits for the versioning."""
        if self._ready is None:
            md5 = self._versions.result()
            request = self._request
            request = request.model_copy(update={"data_version": {**request.data_version, **md5}})
            config = self._checked.config.model_copy(update={"data_version": request.data_version})
            checked = dataclasses.replace(self._checked, config=config)
            job = NodeJob(
                request=request,
                config=checked.config,
                untrained=json.loads((request.model / MODEL_JSON).read_text()),
                data_md5=md5,
            )
            self._ready = job, checked
        return self._ready


@contextlib.contextmanager
def _versioned_in_background(
    checked: Request, request: TrainRequest, settings: Settings
) -> Iterator[_PendingJob]:
    """The job, its data versioned in a thread (with this context: Prefect's run logger)."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="versioning") as pool:
        context = contextvars.copy_context()
        versions = pool.submit(context.run, _data_versions, request, settings)
        try:
            yield _PendingJob(versions, checked, request)
        finally:
            versions.cancel()  # not started yet: never starts; under way: DVC finishes it


# Gangs that lose a node before training starts (a machine dying as it is placed) are placed
# again, this many times at most; a loss during training counts against max_restarts.
PLACEMENTS = 3


def _run_gang(pending: _PendingJob, run: _Run, settings: Settings, log: Any) -> list[NodeOutcome]:
    """The gang, placed and trained, again from the last checkpoint when a node is lost."""
    request = run.request
    params = request.params
    restarts, placements = request.max_restarts, PLACEMENTS
    while True:
        try:
            with _Gang(request, settings, log) as gang:
                return gang.run(pending, run)
        except NodeLost as lost:
            if isinstance(lost, DriverNodeLost):
                log.warning(
                    "%s; joining the cluster at %s again (waiting up to %d s)",
                    lost, params.cluster, params.cluster_timeout_s,
                )  # fmt: skip
                reconnect(str(params.cluster), params.cluster_timeout_s, log)
            if lost.training:
                restarts -= 1
            else:
                placements -= 1
            if restarts < 0 or placements < 0:
                raise ClusterUnavailableError(
                    f"Run {run.id} lost a node on the cluster at {params.cluster} "
                    f"{request.max_restarts + 1} times while training ({lost}).",
                    "Check the nodes' health (ray status), then start the job again: it "
                    "resumes from its last checkpoint. More attempts: max_restarts.",
                ) from None
            log.warning(
                "a node of run %s was lost (%s); the job starts again from its last checkpoint "
                "once the cluster offers %d nodes again (waiting up to %d s)",
                run.id, lost, params.nodes, params.cluster_timeout_s,
            )  # fmt: skip


class _Run:
    """The job's MLflow run: opened once the precision is decided, then reused by every gang."""

    def __init__(
        self, client: MlflowClient, experiment_id: str, settings: Settings, request: TrainRequest
    ) -> None:
        self.client, self.experiment_id = client, experiment_id
        self.settings, self.request = settings, request
        self.id: str | None = request.run_id

    @property
    def dir(self) -> Path:
        return self.settings.runs_dir / str(self.id)

    def config(self, checked: Request, precision: str) -> RunConfig:
        """The run's config with ``precision``, the run opened (or continued) first."""
        if self.id is None:
            decided = Request(
                checked.spec,
                checked.config.model_copy(update={"precision": precision}),
                checked.train_manifest,
                checked.val_manifest,
                precision_decided=True,
            )
            self.id = resume_or_create_run(
                self.client, self.experiment_id, decided, self.settings, self.request.run_name
            )
        self.client.update_run(self.id, status="RUNNING")
        return checked.config.model_copy(
            update={"precision": precision, "run_dir": self.dir, "mlflow_run_id": self.id}
        )


def _require_servers(settings: Settings) -> None:
    """Nodes share state through servers only: a local MLflow store cannot be one."""
    uri = settings.tracking_uri
    if not uri.startswith(("http://", "https://", "postgresql", "mysql")):
        raise InvalidParameterError(
            f"Training on a cluster needs an MLflow server every node reaches; the tracking "
            f"store is {redact_uri(uri)}, which only this machine sees.",
            "Set IMAGEOPS_MLFLOW_TRACKING_URI to the team's MLflow server (imageops team "
            "server prints it), or train on this machine (no cluster).",
        )


def _data_versions(request: TrainRequest, settings: Settings) -> dict[str, str]:
    """The DVC md5 of each data set, versioning (dvc add + push) what has none yet."""
    from tasks.data.versioning import version

    md5 = {}
    for name, path in (("train", request.train_data), ("val", request.val_data)):
        md5[name] = request.data_version.get(name) or version(path, settings)
    return md5


def _cluster_device(request: TrainRequest) -> str:
    """``device`` for the cluster: auto is CUDA when the cluster has a GPU per process."""
    import ray

    params = request.params
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if params.device != "auto":
        return params.device
    return "cuda" if gpus >= params.world_size else "cpu"


class _Gang:
    """One attempt of the job: a placement group and one actor per node, removed on exit."""

    def __init__(self, request: TrainRequest, settings: Settings, log: Any) -> None:
        self.request, self.settings, self.log = request, settings, log
        self.group: PlacementGroup | None = None
        self.agents: list[ActorHandle] = []
        self.parts = JobParts()  # ended whole on exit
        self.nodes: list[NodeInfo] = []
        self.health = GangWatch()

    def __enter__(self) -> _Gang:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        params = self.request.params
        bundle = {"CPU": float(params.nproc_per_node)}
        if params.device == "cuda" or (
            params.device == "auto" and ray.cluster_resources().get("GPU", 0) >= params.world_size
        ):
            bundle["GPU"] = float(params.nproc_per_node)
        self.group = placement_group([bundle] * params.nodes, strategy="STRICT_SPREAD")
        self.parts.groups.append(self.group)
        self._wait_for_capacity(bundle)
        agent = ray.remote(max_concurrency=2, max_restarts=0)(NodeAgent)
        servers = server_settings(self.settings)
        self.agents = [
            agent.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=rank
                ),
            ).remote(servers, rank == 0 and params.precision != "fp32")
            for rank in range(params.nodes)
        ]
        self.parts.actors.extend(self.agents)
        self.nodes = self._get(
            [a.where.remote() for a in self.agents],
            "start",
            training=False,
            within=max(float(params.cluster_timeout_s), AGENT_START_S),
        )
        self.health.watch(
            [
                (a, f"{n.address}, {n.hostname}")
                for a, n in zip(self.agents, self.nodes, strict=True)
            ]
        )
        self.log.info("nodes: %s", ", ".join(f"{n.address} ({n.hostname})" for n in self.nodes))
        return self

    def _wait_for_capacity(self, bundle: dict[str, float]) -> None:
        import ray

        params = self.request.params
        assert self.group is not None
        deadline, placed = time.monotonic() + params.cluster_timeout_s, self.group.ready()
        while time.monotonic() < deadline:  # short waits: a cancellation lands within POLL_S
            ready, _ = wait_refs([placed], timeout=POLL_S)
            if ready:
                return
            self.health.check(training=False)
        alive = [n for n in ray.nodes() if n.get("Alive")]
        fit = [
            n["NodeManagerAddress"]
            for n in alive
            if all(n.get("Resources", {}).get(k, 0) >= v for k, v in bundle.items())
        ]
        raise ClusterUnavailableError(
            f"The cluster at {params.cluster} offered {len(fit)} of the {params.nodes} nodes "
            f"asked for ({', '.join(f'{k} {v:g}' for k, v in bundle.items())} each, one node "
            f"per machine) within {params.cluster_timeout_s} s; nodes alive: {len(alive)} "
            f"({', '.join(fit) or 'none with room'} with room).",
            "Join more machines (imageops team join), ask for fewer nodes or processes per "
            "node, or wait longer with cluster_timeout_s.",
        )

    def run(self, pending: _PendingJob, run: _Run) -> list[NodeOutcome]:
        """Every node gets the data (node 0 decides the precision), then all train."""
        job, checked = pending.get()
        calls = [a.prepare.remote(job, rank) for rank, a in enumerate(self.agents)]
        precision = str(self._get(calls, "prepare", training=False, within=PREPARE_TIMEOUT_S)[0])
        config = run.config(checked, precision)
        params = self.request.params
        self.log.info(
            "MLflow run %s: %d nodes x %d processes on the cluster at %s",
            run.id, params.nodes, params.nproc_per_node, params.cluster,
        )  # fmt: skip
        head = self.nodes[0]
        endpoint = f"{_host(head.address)}:{head.port}"
        calls = [
            agent.train.remote(
                job.model_copy(update={"config": config}),
                NodePlace(rank, endpoint, self.nodes[rank].address, params.rdzv_timeout_s),
            )
            for rank, agent in enumerate(self.agents)
        ]
        try:
            return self._get(calls, "train", training=True)
        except ImageOpsError as error:
            # A peer's torchrun fails the moment a node's store or ranks vanish, well before
            # the cluster declares that node dead: a node that died meanwhile is the cause.
            lost = self._lost_node(calls) if error.retryable else None
            if lost is None:
                raise
            raise NodeLost(f"node {lost}; the others failed with it", training=True) from None

    def _lost_node(self, calls: list[Any]) -> str | None:
        """The address of a gang node the cluster finds dead within LOSS_GRACE_S, else None."""
        import ray

        deadline = time.monotonic() + LOSS_GRACE_S
        ours = {node.node_id for node in self.nodes}
        while time.monotonic() < deadline:
            dead = [
                n["NodeManagerAddress"]
                for n in ray.nodes()
                if not n.get("Alive") and n["NodeID"] in ours
            ]
            if dead:
                return dead[0]
            done, _ = wait_refs(calls, num_returns=len(calls), timeout=1.0)
            for ref in done:
                try:
                    ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError):
                    return "of an actor that died"
                except Exception:  # the node's own failure: alive, just failed
                    continue
        return None

    def _get(
        self, calls: list[Any], what: str, *, training: bool, within: float | None = None
    ) -> list[Any]:
        """The calls' values; the first failure raised as the node's own error.

        Raises NodeLost when a node's actor or machine died or stopped answering, or the driver's
        own node died (``training``: while training); ClusterUnavailableError when the calls
        take longer than ``within`` seconds.
        """
        import ray

        pending = list(calls)
        deadline = None if within is None else time.monotonic() + within
        while pending:  # short waits: an interrupt or a cancellation lands within POLL_S
            done, pending = wait_refs(pending, num_returns=1, timeout=POLL_S)
            for ref in done:
                try:
                    ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError) as exc:
                    raise NodeLost(str(exc).splitlines()[0], training) from None
                except ray.exceptions.RayTaskError as exc:
                    cause = exc.cause
                    if isinstance(cause, ImageOpsError):
                        raise cause from None
                    raise ClusterUnavailableError(
                        f"A node of the cluster job failed to {what}: {cause!r}.",
                        "The node's lines above (prefixed with its address) say why.",
                    ) from None
            if pending and deadline is not None and time.monotonic() > deadline:
                raise ClusterUnavailableError(
                    f"{len(pending)} of the {len(calls)} nodes of the job on the cluster at "
                    f"{self.request.params.cluster} did not {what} within {within:.0f} s.",
                    "The nodes' lines above (prefixed with their address) and `ray status` on "
                    "the cluster say why; start the job again: it resumes from its last "
                    "checkpoint.",
                )
            if pending:
                self.health.check(training)
        return ray.get(calls)

    def __exit__(self, *exc: object) -> None:
        self.parts.end()  # each agent's torchrun and workers die with it (parent death)


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _unpack(outcomes: list[NodeOutcome], run_dir: Path, out: Path) -> dict[str, Any]:
    """Write what the nodes sent into the run folder here and the model into ``out``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lead = next((o for o in outcomes if o.lead), None)
    for outcome in outcomes:
        for name, data in outcome.files.items():
            if not name.startswith("model/"):
                write_bytes(run_dir / name, data)
    if lead is None:
        raise ClusterUnavailableError(
            f"Every node finished, but none ran rank 0: no {RESULT} came back to {run_dir}.",
            "The nodes' torchrun logs in the run folder say why.",
        )
    with atomic_directory(Path(out), replaces=MODEL_JSON) as tmp:
        for name, data in lead.files.items():
            if name.startswith("model/"):
                (tmp / name.removeprefix("model/")).write_bytes(data)
    return json.loads(lead.files[RESULT])
