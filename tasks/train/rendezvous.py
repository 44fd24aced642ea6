"""How the nodes of a cluster job meet: what torchrun prints when they do not, as our error.

torch's own message says only that a rendezvous timed out or could not connect; the error here
names the run, the endpoint, the node that waited and how long.
"""

from __future__ import annotations

from tasks.shared.errors import RendezvousTimeoutError

# What torchrun prints when its rendezvous times out / cannot reach the store.
RDZV_TIMEOUT_MARK = "RendezvousTimeoutError"
RDZV_CONNECTION_MARK = "RendezvousConnectionError"


def rendezvous_timeout(
    run_id: str, endpoint: str, node: str, nodes: int, timeout_s: int
) -> RendezvousTimeoutError:
    """Node ``node`` waited ``timeout_s`` at ``endpoint`` and not all ``nodes`` came."""
    return RendezvousTimeoutError(
        f"The rendezvous of training run {run_id} at {endpoint} timed out after {timeout_s} s: "
        f"{node} waited there, and not all {nodes} nodes arrived.",
        f"Check that every node reaches {endpoint} (its port open between the cluster's "
        "machines, the nodes' addresses routable), then start the job again; or allow more "
        "time with rdzv_timeout_s (--rdzv-timeout-s).",
    )
