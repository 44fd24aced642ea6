"""Where a scoring job's actors run: each pinned to a node that does work, shared by cores.

Ray Data places an actor pool with Ray's SPREAD, which is best effort. An actor that asks for no
core (ours: the read tasks need the cores) fits the team server's Ray head, started with
`--num-cpus 0` so that it does no work, and SPREAD put one there in 4 of 4 runs of 2 actors on a
head and 2 two-core nodes; kept off the head, both actors still shared one node in 2 of 4 runs,
the other node idle. So each actor is pinned by the label every Ray node has (its node id) to
its slot (:func:`actor_slots`), and may fall back to any node of the job (its own node lost before
it started or while it restarts). Measured with ``ray.cluster_utils.Cluster``: 3 runs of 3, one
actor on each node, none on the head.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

from tasks.shared.errors import ClusterUnavailableError

NODE_ID = "ray.io/node-id"  # the label Ray gives every node


def actor_slots(nodes: Iterable[Mapping[str, Any]], threads: int) -> list[str]:
    """The node id of each actor a job starts, in the order they start (``ray.nodes()``).

    With GPUs: one actor per GPU, on the GPU nodes only. Otherwise one actor per ``2 * threads``
    of the cluster's cores (at least one: the other half of the cores read), each given to the
    node with the most cores left for it. Nodes in the order of their address, so the same
    cluster gives the same placement.
    """
    alive = sorted(
        (n for n in nodes if n.get("Alive")),
        key=lambda n: (n.get("NodeManagerAddress", ""), n["NodeID"]),
    )
    gpus = [(n["NodeID"], int(n["Resources"].get("GPU", 0))) for n in alive]
    if any(count for _, count in gpus):
        rounds = [[node] * count for node, count in gpus if count]
        return [node for turn in itertools.zip_longest(*rounds) for node in turn if node]
    cores = {n["NodeID"]: int(n["Resources"].get("CPU", 0)) for n in alive}
    given = {node: 0 for node, count in cores.items() if count}
    slots: list[str] = []
    for _ in range(max(1, sum(cores.values()) // (2 * threads)) if given else 0):
        # The most cores per actor once it has this one; of equals, the one with fewer actors,
        # then the first by address: 8 and 4 cores give a, b, a, a, b, a.
        node = max(given, key=lambda n: (cores[n] / (given[n] + 1), -given[n]))
        given[node] += 1
        slots.append(node)
    return slots


class Placement:
    """Ray Data's ``ray_remote_args_fn`` for an actor pool over ``slots``: called once per
    actor it starts (again for one started later), it gives the next slot's node."""

    def __init__(self, slots: list[str]) -> None:
        if not slots:
            raise ClusterUnavailableError(
                "No node of the Ray cluster has a core or a GPU to score on (a team server's "
                "Ray head does no work: `ray status` lists the nodes).",
                "Join a machine to the cluster (`imageops team join` on it, or `ray start "
                "--address HEAD:6379`), then run the same command again.",
            )
        self.slots = slots
        self._next = itertools.count()
        anywhere = ",".join(sorted(set(slots)))
        self._fallback = [{"label_selector": {NODE_ID: f"in({anywhere})"}}]

    def __call__(self) -> dict[str, Any]:
        node = self.slots[next(self._next) % len(self.slots)]
        return {"label_selector": {NODE_ID: node}, "fallback_strategy": self._fallback}
