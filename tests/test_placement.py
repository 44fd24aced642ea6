"""Where a scoring job's actors go (tasks/cluster/placement.py), from the nodes as `ray.nodes()`
lists them: never the team server's 0-CPU head, one node after another, GPUs only on GPU nodes.
The placement on a real cluster of two hosts: tests/test_cluster_hosts.py (its score tests)."""

from __future__ import annotations

import pytest

from tasks.cluster.placement import NODE_ID, Placement, actor_slots
from tasks.shared.errors import ClusterUnavailableError


def node(name: str, address: str, cpus: float, gpus: float = 0, alive: bool = True) -> dict:
    resources = {"CPU": cpus, "memory": 1e9} | ({"GPU": gpus} if gpus else {})
    return {"NodeID": name, "NodeManagerAddress": address, "Alive": alive, "Resources": resources}


HEAD = node("head", "10.0.0.254", 0)  # `imageops team serve`'s Ray head: --num-cpus 0


def test_the_team_servers_head_gets_no_actor_and_the_nodes_take_turns() -> None:
    nodes = [node("b", "10.0.0.2", 2), HEAD, node("a", "10.0.0.1", 2)]
    assert actor_slots(nodes, threads=1) == ["a", "b"]  # one per host, in address order
    big = [HEAD, node("a", "10.0.0.1", 8), node("b", "10.0.0.2", 4)]
    assert sorted(actor_slots(big, threads=1)) == ["a"] * 4 + ["b"] * 2  # half the cores each
    assert actor_slots(big, threads=1)[:3] == ["a", "b", "a"]  # the pool's first ones spread
    assert sorted(actor_slots(big, threads=2)) == ["a", "a", "b"]


def test_one_core_nodes_a_dead_node_and_gpu_nodes() -> None:
    ones = [
        node("a", "10.0.0.1", 1),
        node("b", "10.0.0.2", 1),
        node("c", "10.0.0.3", 2, alive=False),
    ]
    assert actor_slots(ones, threads=1) == ["a"]  # 2 cores in all: 1 actor, as on one host
    assert actor_slots(ones[:1], threads=1) == ["a"]  # one core still gets its actor
    gpus = [HEAD, node("cpu", "10.0.0.1", 16), node("g", "10.0.0.2", 8, gpus=2)]
    assert actor_slots(gpus, threads=1) == ["g", "g"]  # one actor per GPU, on its node only
    assert actor_slots([HEAD], threads=1) == []


def test_each_actor_is_pinned_to_the_next_slot_with_the_jobs_nodes_to_fall_back_to() -> None:
    placement = Placement(["a", "b"])
    pins = [placement() for _ in range(3)]  # Ray Data calls it once per actor it starts
    assert [p["label_selector"] for p in pins] == [{NODE_ID: "a"}, {NODE_ID: "b"}, {NODE_ID: "a"}]
    assert pins[0]["fallback_strategy"] == [{"label_selector": {NODE_ID: "in(a,b)"}}]
    with pytest.raises(ClusterUnavailableError, match="No node of the Ray cluster has a core") as e:
        Placement(actor_slots([HEAD], threads=1))  # the team's server alone: no machine joined
    assert "imageops team join" in e.value.hint
