"""Is the gang still there: every node agent answers, and the driver's own Ray node lives.

Ray says that an actor died only once its process or its machine is gone. An agent that stops
answering (a frozen process, a machine cut off but not yet declared dead) leaves every call on it
pending for ever; so does every actor of a driver whose own Ray node died: a machine whose node
died and joined again is another node, and actors owned by the driver of the dead one never start.
While the driver waits on its gang it checks both, every HEALTH_EVERY_S: a ping to each agent
(the agents run two calls at a time, so a ping gets through beside a training), and its own node
in the cluster's table. Details: docs/training.md#failures-and-cancellation.
"""

from __future__ import annotations

import time
from typing import Any

# How often the driver checks its gang while it waits, and how long an agent may leave a ping
# unanswered before its node counts as lost (a busy machine answers within a second or two).
HEALTH_EVERY_S = 5.0
ANSWER_TIMEOUT_S = 60.0


class NodeLost(Exception):
    """A node of the gang died (or its machine went away); ``training``: after training began."""

    def __init__(self, what: str, training: bool) -> None:
        super().__init__(what)
        self.training = training


class DriverNodeLost(NodeLost):
    """The driver's own Ray node died: it must join the cluster again before its next gang."""


def wait_refs(refs: list[Any], **options: Any) -> tuple[list[Any], list[Any]]:
    """``ray.wait``, letting an interrupt through as itself.

    A signal's exception raised while Ray's wait runs (Ctrl-C, or the TerminationSignal of a
    cancelled flow run) comes out of it as a SystemError caused by that exception: a stop must
    stay a stop, never turn into a failure that Prefect retries.
    """
    import ray

    try:
        return ray.wait(refs, **options)
    except SystemError as error:
        stop = error.__cause__ or error.__context__
        if isinstance(stop, BaseException) and not isinstance(stop, Exception):
            raise stop from None
        raise


class GangWatch:
    """The driver's checks on one gang, each at most every HEALTH_EVERY_S (see the module)."""

    def __init__(self) -> None:
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.agents: list[tuple[Any, str]] = []  # (actor, where it runs), once it has started
        self._pings: dict[int, tuple[Any, float]] = {}  # agent index: (pending ping, sent at)
        self._next = 0.0

    def watch(self, agents: list[tuple[Any, str]]) -> None:
        """Ping these agents from now on (they have started: they answer calls)."""
        self.agents, self._pings = agents, {}

    def check(self, training: bool) -> None:
        """Raise NodeLost when an agent stopped answering or died, or this driver's node died."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + HEALTH_EVERY_S
        self._check_own_node(training)
        for index, (agent, where) in enumerate(self.agents):
            sent = self._pings.get(index)
            if sent is not None:
                ping, at = sent
                if not wait_refs([ping], timeout=0)[0]:
                    if now - at > ANSWER_TIMEOUT_S:
                        raise NodeLost(
                            f"node {index} ({where}) did not answer for {ANSWER_TIMEOUT_S:.0f} s",
                            training,
                        )
                    continue
                self._answered(ping, index, where, training)
            self._pings[index] = (agent.ping.remote(), now)

    def _answered(self, ping: Any, index: int, where: str, training: bool) -> None:
        import ray

        try:
            ray.get(ping)
        except (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise NodeLost(f"node {index} ({where}): {first}", training) from None

    def _check_own_node(self, training: bool) -> None:
        import ray

        try:
            nodes = ray.nodes()
        except Exception:  # the cluster's table did not answer now: the next check asks again
            return
        mine = next((n for n in nodes if n.get("NodeID") == self.node_id), None)
        if mine is None or not mine.get("Alive"):
            where = mine["NodeManagerAddress"] if mine else "gone from the cluster"
            raise DriverNodeLost(
                f"this machine's Ray node ({where}), through which this driver owns the gang, died",
                training,
            )


def live_nodes() -> dict[str, str]:
    """The cluster's live nodes: node id -> its address and host name, "10.0.0.7 (gpu-3)", as a
    person finds it in `ray status` and on the machine. A job takes this at its start and again
    at its end to name the nodes it lost on the way."""
    import ray

    return {
        node["NodeID"]: f"{node['NodeManagerAddress']} ({node.get('NodeManagerHostname', '?')})"
        for node in ray.nodes()
        if node.get("Alive")
    }
