"""Multi-node bookkeeping: where the node agents meet, and which of them came.

Each node notes in the shared run folder when its torchrun ran, so a rendezvous that times out
can say which nodes arrived and which did not (torch says only that it timed out).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from models.atomic import write_json
from tasks.shared.errors import RendezvousTimeoutError
from tasks.shared.servers import free_port

if TYPE_CHECKING:
    from tasks.train.request import TrainRequest

# torchrun's own default for how long nodes wait for each other at the rendezvous.
RDZV_TIMEOUT_S = 600
# What torchrun prints when its rendezvous times out / cannot reach the store.
RDZV_TIMEOUT_MARK = "RendezvousTimeoutError"
RDZV_CONNECTION_MARK = "RendezvousConnectionError"
CLOCK_SLACK_S = 1.0
NODES = "nodes"  # in the run folder: when each node's torchrun ran


def local_rendezvous_endpoint() -> str:
    """``127.0.0.1:<a port free now>``: the rendezvous of node agents that all run here.

    Agents on other machines cannot reach a loopback address, so no stranger joins the job by
    chance (torch's store itself listens on the port on every interface: the port is free only
    for a moment before torchrun takes it). Real multi-node jobs name a host all machines reach.
    """
    return f"127.0.0.1:{free_port()}"


def mark_node(run_dir: Path, node_rank: int, started: float, ended: float | None = None) -> None:
    """Note in the shared run folder when this node's torchrun ran: who came to a rendezvous.

    torch's rendezvous timeout says only that it timed out; these notes let the error say which
    nodes came and which did not.
    """
    write_json(
        run_dir / NODES / f"node_{node_rank}.json",
        {
            "node_rank": node_rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": started,
            "ended": ended,
        },
    )


def _arrived_nodes(run_dir: Path, nodes: int, started: float, timeout_s: int) -> set[int]:
    """Node ranks whose torchrun was up while this node's waited (``started`` on).

    A node that came earlier and was still waiting started at most ``timeout_s`` before us; a
    note of an earlier attempt ended before we started. A second of slack covers clock skew.
    """
    arrived = set()
    for path in (run_dir / NODES).glob("node_*.json"):
        try:
            note = json.loads(path.read_text())
            rank, began, ended = int(note["node_rank"]), float(note["started"]), note["ended"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        recent = began >= started - timeout_s - CLOCK_SLACK_S
        overlapping = ended is None or float(ended) >= started - CLOCK_SLACK_S
        if 0 <= rank < nodes and recent and overlapping:
            arrived.add(rank)
    return arrived


def rendezvous_timeout(
    run_dir: Path, run_id: str, request: TrainRequest, started: float
) -> RendezvousTimeoutError:
    """A timed-out rendezvous, naming the nodes that came and those that did not."""
    params, endpoint, timeout_s = request.params, request.rdzv_endpoint, request.rdzv_timeout_s
    arrived = _arrived_nodes(run_dir, params.nodes, started, timeout_s) | {request.node_rank}
    missing = [rank for rank in range(params.nodes) if rank not in arrived]
    return RendezvousTimeoutError(
        f"The rendezvous of training run {run_id} at {endpoint} timed out after {timeout_s} s: "
        f"{len(arrived)} of {params.nodes} nodes arrived (node rank "
        f"{', '.join(map(str, sorted(arrived)))}; missing: {', '.join(map(str, missing))}).",
        f"Start the agent of every node within {timeout_s} s of the others, each with its "
        f"own node rank, nodes = {params.nodes}, run id {run_id} and rendezvous endpoint "
        f"{endpoint}; check that every node reaches {endpoint}; or allow more time with "
        "rdzv_timeout_s (--rdzv-timeout).",
    )
