"""Run torchrun for one node: its command, its environment, its process tree, its log, its error.

torchrun runs as a subprocess in a session of its own (fork inside a Prefect task can deadlock on
Prefect's threads), and on a timeout, an interrupt or any error the whole process tree is
stopped, so no orphaned worker keeps a GPU or a port. A launcher killed outright (SIGKILL, the
OOM killer) stops nothing itself: torchrun and its workers die with it by a parent-death signal
(:mod:`tasks.shared.parent_death`). A worker's ImageOpsError comes back as the same error class; any
other failure as a TrainingFailedError quoting the log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

import psutil

import tasks
from models.errors import full_disk_at
from tasks.shared.errors import ImageOpsError, TrainingFailedError
from tasks.shared.log_tail import tail
from tasks.shared.parent_death import dying_with_this_process
from tasks.shared.servers import stop_signals
from tasks.shared.settings import Settings, redact_uri
from tasks.shared.step import step_logger
from tasks.train.failure import read_failures
from tasks.train.rendezvous import RDZV_CONNECTION_MARK
from tasks.train.run_folder import rank_log

if TYPE_CHECKING:
    from tasks.train.request import TrainRequest

TORCHRUN_LOG = "torchrun.log"
KILL_GRACE_S = 15.0


def torchrun_environment(
    settings: Settings, run_id: str, env: Mapping[str, str] | None
) -> dict[str, str]:
    """This process's environment, the settings', what the workers need, then ``env`` over all."""
    return {
        **os.environ,
        **settings.environment(),
        "MLFLOW_RUN_ID": run_id,
        "PYTHONUNBUFFERED": "1",  # stream the workers' lines as they come
        # By default the workers share the agent's store across restarts, and a
        # restarted rank 0 can read the killed rank's stale gloo address from it and
        # fail to connect ("Connection refused"); a store per attempt has no stale keys.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # Workers import `tasks` by module name, whatever the working folder.
        "PYTHONPATH": os.pathsep.join(
            p for p in (_source_root(), os.environ.get("PYTHONPATH", "")) if p
        ),
        **(env or {}),
    }


def torchrun_threads(nproc_per_node: int) -> dict[str, str]:
    """``OMP_NUM_THREADS=1`` for several processes on one machine, unless the variable is set.

    torchrun sets the same itself then, and prints a banner saying so ("Setting OMP_NUM_THREADS
    environment variable for each process to be 1 in default ...") on every launch: set here,
    the workers compute the same and the banner goes. One process keeps torch's default (a
    thread per core), as under torchrun.
    """
    if nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        return {"OMP_NUM_THREADS": "1"}
    return {}


def _source_root() -> str:
    return str(Path(tasks.__file__).resolve().parent.parent)


@dataclass(frozen=True)
class NodePlace:
    """Where one node of a cluster job stands: how its torchrun meets the others."""

    node_rank: int
    endpoint: str  # host:port of node 0's rendezvous store, on node 0's own address
    address: str  # this node's address: what its peers dial (never the hostname's 127.0.0.1)
    timeout_s: int  # how long the nodes wait for each other


def torchrun_command(
    request: TrainRequest, config_path: Path, run_id: str, place: NodePlace | None = None
) -> list[str]:
    """torchrun's command line: standalone on one machine, else one node of a cluster job."""
    params = request.params
    command = [sys.executable, "-m", "torch.distributed.run"]
    if place is None:
        # The workers meet at 127.0.0.1, not at the hostname: a host whose name does not resolve
        # (a container or network namespace without an /etc/hosts line) hung them for ever.
        command += ["--standalone", "--nnodes", "1", "--local-addr", "127.0.0.1"]
        command += ["--max-restarts", str(request.max_restarts)]
    else:
        # c10d at node 0's store; the cluster restarts the whole gang, so torchrun does not.
        is_host = "1" if place.node_rank == 0 else "0"
        command += [
            "--nnodes", str(params.nodes),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", place.endpoint,
            "--rdzv-id", run_id,
            "--rdzv-conf", f"join_timeout={place.timeout_s},is_host={is_host}",
            "--local-addr", place.address,
            "--max-restarts", "0",
        ]  # fmt: skip
    command += [
        "--nproc-per-node",
        str(params.nproc_per_node),
        "-m",
        "tasks.train.worker",
        "--config",
        str(config_path),
    ]
    return command


# torchrun's lines that tell the user nothing to act on, kept out of the console and the log.
# c10d names every socket's peer by reverse DNS, for its own debug messages, and warns when the
# lookup fails (a container or network namespace without a resolver) before it goes on with the
# numeric address: on such a machine every connection of a cluster job printed it.
NOT_THE_USERS_BUSINESS = ("[c10d] The hostname of the client socket cannot be retrieved.",)


def _pump(stream: IO[str], path: Path, on_line: Callable[[str], bool] | None = None) -> None:
    """Copy torchrun's output to the console and to its log in the run folder, line by line, and
    hand each line to ``on_line`` (the Prefect run's watch: tasks.train.watch), which says
    whether it logged the line itself.

    A worker's traceback may quote a settings URI (MLflow's errors do): passwords are masked.
    Tracebacks go to the log only: the console keeps the error line and says where the rest is,
    as the CLI does for every error (the named error that ends the run says what to do).
    """
    in_traceback = False
    with open(path, "a", encoding="utf-8") as sink:
        for raw in stream:
            if any(noise in raw for noise in NOT_THE_USERS_BUSINESS):
                continue
            line = redact_uri(raw)
            sink.write(line)
            sink.flush()
            if on_line is not None and _handed(on_line, line):
                continue  # logged by the run's logger, which shows it on the console too
            at = line.find("Traceback (most recent call last):")  # torchrun's report indents it
            if at >= 0:
                in_traceback, line = True, f"{line[:at]}(traceback in {path})\n"
            elif in_traceback and (line[:1] in (" ", "\t") or not line.strip()):
                continue  # a frame of the traceback
            else:
                in_traceback = False  # the exception's own line ends it, and is shown
            sys.stdout.write(line)
            sys.stdout.flush()


def _handed(on_line: Callable[[str], bool], line: str) -> bool:
    """Whether ``on_line`` logged ``line``; a failing one is left out (this thread must drain the
    pipe whatever happens, or torchrun blocks on a full one)."""
    try:
        return on_line(line)
    except Exception:
        return False


# Set when this command is stopping: Ctrl-C and SIGTERM reach only the main thread, and a
# training in another thread (a study's parallel trials) would run to its end first.
STOPPING = threading.Event()


@contextlib.contextmanager
def trainings_stop_when_interrupted() -> Iterator[None]:
    """A Ctrl-C or SIGTERM raised inside (KeyboardInterrupt, Prefect's TerminationSignal) stops
    every training this process runs: each :func:`run_torchrun` stops its torchrun within half a
    second. Around the code that waits for trainings in other threads (a study's trials), so they
    stop before anything waits for them to end (a task runner's shutdown does)."""
    STOPPING.clear()  # a command run earlier in this process (a test) may have stopped
    try:
        yield
    except BaseException as stop:
        if not isinstance(stop, Exception):
            STOPPING.set()
        raise


@contextlib.contextmanager
def trainings_stop_with_the_command() -> Iterator[None]:
    """Inside, SIGTERM and SIGINT are Ctrl-C (:func:`~tasks.shared.servers.stop_signals`;
    a Prefect flow has its own SIGTERM bridge), and either stops every training this process
    runs, not only the main thread's."""
    with stop_signals(), trainings_stop_when_interrupted():
        yield


def run_torchrun(
    command: list[str],
    env: dict[str, str],
    run_dir: Path,
    timeout_s: float | None,
    *,
    log_name: str = TORCHRUN_LOG,
    on_line: Callable[[str], bool] | None = None,
) -> int:
    step_logger(__name__).info("starting: %s", " ".join(command))
    proc = subprocess.Popen(
        # SIGKILLed with this process; its workers die with it (tasks.train.worker's main).
        dying_with_this_process(command),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        encoding="utf-8",
        errors="replace",
        bufsize=1,
        start_new_session=True,  # its own process group: we can stop all of it, and only it
    )
    assert proc.stdout is not None
    pump = threading.Thread(
        target=_pump, args=(proc.stdout, run_dir / log_name, on_line), daemon=True
    )
    pump.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            try:
                # Short waits keep this thread responsive to an interrupt or a cancellation.
                returncode = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if STOPPING.is_set():
                    raise KeyboardInterrupt from None  # the command is stopping
                if deadline is not None and time.monotonic() > deadline:
                    raise TrainingFailedError(
                        f"Training ran longer than timeout_s = {timeout_s} s and was stopped.",
                        f"The checkpoint and logs are in {run_dir}; resume with run_id, or allow "
                        "more time.",
                    ) from None
    except BaseException:
        _stop_process_tree(proc)
        raise
    finally:
        pump.join(timeout=10)
    return returncode


def _stop_process_tree(proc: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM torchrun's process group and every descendant, then SIGKILL what remains.

    torchrun starts each worker in a session of its own, so the group alone would miss them: the
    descendants are listed first, while torchrun still links them.
    """
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    _signal_group(proc.pid, signal.SIGTERM)
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(descendants, timeout=grace_s)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=1.0)
    _signal_group(proc.pid, signal.SIGKILL)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    proc.wait()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pgid, sig)


def torchrun_failure(
    run_dir: Path, returncode: int, torchrun_log: Path, output: str = ""
) -> ImageOpsError:
    """The error to raise for a failed torchrun: the worker's own error class when it had one.

    ``output`` is what this launch's torchrun printed (its log holds earlier launches too).
    """
    if RDZV_CONNECTION_MARK in output:
        return TrainingFailedError(
            f"torchrun could not reach the rendezvous of run {run_dir.name}. Last lines of "
            f"{torchrun_log}:\n{tail(torchrun_log)}",
            "Check the rendezvous endpoint (host:port of a machine every node reaches, open in "
            "its firewall) and start the agent on that host first.",
        )
    failures = read_failures(run_dir)
    # The workers could not even write down why they failed: their disk is full.
    if not failures and (full := full_disk_at("the run folder", run_dir)) is not None:
        return full
    for failure in failures:
        error = failure.as_error()
        if error is not None:
            return error
    if failures:
        first = failures[0]
        where = rank_log(run_dir, first.rank)
        what = f"rank {first.rank} failed with {first.type}: {first.message}"
    else:  # killed by a signal, or died before its logging started
        where = rank_log(run_dir, 0)
        what = f"torchrun exited with code {returncode}"
        if not where.is_file():
            where = torchrun_log
    return TrainingFailedError(
        f"Training failed: {what}. Last lines of {where}:\n{tail(where)}",
        f"Every rank's log is in {run_dir} (rank_0.log is the master's).",
    )
