"""A cluster job stopped whole: none of its tasks or actors outlive the driver's stop.

A job ends its own actors and placement groups when an attempt ends (:class:`JobParts`); an
interrupt (Ctrl-C, the TerminationSignal of a cancelled flow run) leaves the cluster as well
(:func:`stopped_whole`), which ends every task and actor the driver owns, those Ray Data started
for it too, on every node.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tasks.cluster.connect import leave


class JobParts:
    """The actors and placement groups of one attempt of a job, ended together by :meth:`end`."""

    def __init__(self) -> None:
        self.actors: list[Any] = []
        self.groups: list[Any] = []

    def end(self) -> None:
        """Kill every actor (its processes die with it) and remove every placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        for group in self.groups:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        self.actors, self.groups = [], []


@contextlib.contextmanager
def stopped_whole() -> Iterator[None]:
    """Run a job's driver side; an interrupt leaves the cluster, ending all the job's work.

    A failure (an Exception) is the job's own: the caller ends its parts and may try again.
    """
    try:
        yield
    except BaseException as stop:
        if not isinstance(stop, Exception):
            leave()
        raise
