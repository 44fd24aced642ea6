"""The fork server that loader processes (training's loaders, scoring's readers) come from,
startable before torch is imported.

Forking the training process could inherit a held lock (NCCL's, CUDA's, MLflow's) and deadlock;
spawning imports torch anew in each loader process (seconds each). The fork server imports once and
forks loader processes in milliseconds. Its import takes as long as the training process's own
(about 10 s on a fresh H100 machine), so the torchrun worker starts it first thing: the two imports
run side by side instead of one after the other. This module imports no torch for that reason.
Details: docs/training.md#the-fork-server.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.forkserver
from multiprocessing.context import BaseContext
from pathlib import Path

# What a loader process needs, imported once by the fork server: torch, torchvision and PIL come
# with these.
LOADER_MODULES = ("tasks.train.data", "tasks.data.transform")


def start_fork_server() -> BaseContext:
    """The fork server's context, starting the server in the background if none runs yet."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(LOADER_MODULES))  # no effect once the server runs
    multiprocessing.forkserver.ensure_running()
    return context


def start_for_worker(argv: list[str]) -> None:
    """Start the fork server now if the worker's run (``--config FILE``) uses loader processes.

    Those are the runs on CUDA, or with ``num_workers`` set above 0 (as
    :func:`tasks.train.data.loader_workers` decides); a CPU run loads in its own process, and a
    server would only compete with its start. Reads config.json as plain JSON: the worker has not
    imported pydantic or torch yet. A missing or unreadable file is left to the worker to report.
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", type=Path)
    args, _ = parser.parse_known_args(argv)
    try:
        config = json.loads(args.config.read_text()) if args.config else {}
        workers = config.get("params", {}).get("num_workers")
    except (OSError, ValueError, AttributeError):
        return
    uses_processes = config.get("device") == "cuda" if workers is None else workers > 0
    if uses_processes:
        start_fork_server()
