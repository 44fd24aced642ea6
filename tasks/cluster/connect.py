"""Joining a Ray cluster as a driver: one address (or the team's), one wait, one error that
names both.

Ray retries an address where nothing listens for ever, and ``ray.init`` has no timeout: a plain
TCP connection to the head's port comes first, then ``ray.init`` in a thread the wait can leave.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from tasks.shared.errors import ClusterUnavailableError
from tasks.shared.settings import Settings

TEAM = "team"  # a job's cluster: the team's, when this machine is in one (IMAGEOPS_RAY_ADDRESS)


def cluster_address(
    cluster: str | None, settings: Settings, log: Any, *, required: bool = False
) -> str | None:
    """The Ray head a job runs on: ``cluster`` as given, or for ``team`` the team's cluster when
    this machine joined one (``IMAGEOPS_RAY_ADDRESS``, which ``imageops team join`` gives every
    flow run), else None: this machine. The promotion trigger passes ``team``, so a promotion
    scores on the cluster of a team and on its own machine everywhere else.

    With ``required`` (a person who typed ``--cluster team``), a machine in no team raises
    ClusterUnavailableError instead: nobody asked for one machine's pace on purpose.
    """
    if cluster != TEAM:
        return cluster
    if settings.ray_address:
        log.info("cluster=team: the team's Ray cluster at %s (IMAGEOPS_RAY_ADDRESS)",
                 settings.ray_address)  # fmt: skip
        return settings.ray_address
    if required:
        raise ClusterUnavailableError(
            "--cluster team: this machine is in no team (IMAGEOPS_RAY_ADDRESS is not set).",
            "Source the team's join file (set -a; . ~/.config/imageops/team.env; set +a) on a "
            "machine that ran `imageops team join`, or give the cluster's head as "
            "--cluster HOST:6379, or leave --cluster out to score on this machine.",
        )
    log.info("cluster=team: this machine is in no team (IMAGEOPS_RAY_ADDRESS unset): the "
             "job runs here")  # fmt: skip
    return None


def connect(address: str, timeout_s: int, log: Any) -> None:
    """Join the cluster as a driver, or fail naming the address within ``timeout_s``.

    Ray itself retries an address where nothing listens for ever: a plain TCP connect to the
    head's port tells first whether anything is there.
    """
    # Read when Ray is imported. Ray's log deduplication keys a line by its words without digits
    # and holds back one that another process printed in the last 5 s, to print it later, out of
    # order (a 2-node job showed a node's line below lines 27 s newer: old lines printed again),
    # or folded into "[repeated 2x across cluster]" (the line itself never shown).
    # Each node's torchrun output reaches the driver once: nothing to fold.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray

    global _connected
    if ray.is_initialized():
        if _connected == address:
            return
        ray.shutdown()  # another cluster than this job's
    deadline = time.monotonic() + timeout_s
    log.info("connecting to the Ray cluster at %s", address)
    _wait_for_port(address, deadline)
    failure: list[BaseException] = []

    def init() -> None:
        try:
            ray.init(
                address=address,
                logging_level="ERROR",
                log_to_driver=True,  # the nodes' torchrun lines, prefixed with their address
                configure_logging=False,
            )
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    logging.getLogger("ray._private.worker").addFilter(_no_sigterm_handler_notice)
    thread = threading.Thread(target=init, daemon=True, name="ray-connect")
    thread.start()
    thread.join(max(1.0, deadline - time.monotonic()))
    if thread.is_alive() or failure:
        why = f": {failure[0]}" if failure else f": no answer in {timeout_s} s"
        raise _unreachable(address, why, timeout_s)
    _connected = address


_connected: str | None = None
# How long leaving a cluster may take: a driver whose own node died may find Ray's shutdown slow.
DISCONNECT_TIMEOUT_S = 30.0
REJOIN_PAUSE_S = 5.0


def reconnect(address: str, timeout_s: int, log: Any) -> None:
    """Leave the cluster and join it again within ``timeout_s``: after this machine's Ray node
    died, a driver must join through the node that takes its place to own actors again (Ray
    waits 60 s for a node on this machine: tried again until ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        leave()
        try:
            connect(address, max(1, int(deadline - time.monotonic())), log)
            return
        except ClusterUnavailableError:
            if time.monotonic() + REJOIN_PAUSE_S >= deadline:
                raise
        time.sleep(REJOIN_PAUSE_S)


def leave() -> None:
    """Leave the cluster (``ray.shutdown``), waited for DISCONNECT_TIMEOUT_S at most.

    The cluster then ends every task and actor this driver owns: a job stopped whole.
    """
    import ray

    global _connected
    _connected = None
    leaving = threading.Thread(target=ray.shutdown, daemon=True, name="ray-disconnect")
    leaving.start()
    leaving.join(DISCONNECT_TIMEOUT_S)


def _no_sigterm_handler_notice(record: logging.LogRecord) -> bool:
    """Drop Ray's "SIGTERM handler is not set because current thread is not the main thread."

    ``ray.init`` outside the main thread (here, to have a deadline) skips the handler that would
    exit the driver on SIGTERM, and says so on every job; this process has its own (the CLI's
    stop_signals, a flow run's Prefect bridge), so nothing is missing.
    """
    return not record.getMessage().startswith("SIGTERM handler is not set")


def _wait_for_port(address: str, deadline: float) -> None:
    """Until ``deadline``, try a TCP connection to ``host:port`` (other address forms pass)."""
    host, _, port = address.rpartition(":")
    if "://" in address or not port.isdigit():
        return
    host = host.strip("[]")
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2.0):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise _unreachable(address, f": {exc.strerror or exc}", None) from None
        time.sleep(1.0)


def _unreachable(address: str, why: str, timeout_s: int | None) -> ClusterUnavailableError:
    return ClusterUnavailableError(
        f"Could not reach the Ray cluster at {address}{why}"
        + (f" (waited {timeout_s} s)." if timeout_s else "."),
        "Check the address (host:port of the cluster's head, 6379 by default: `ray status "
        "--address HOST:6379` on a node tells), that this machine is one of the cluster's nodes "
        "(imageops team join); wait longer with cluster_timeout_s "
        "(--cluster-timeout-s).",
    )
