"""Server processes: a free port, a start that dies with us, a wait until it answers, a stop.

One way for every server imageops or its tests start (``imageops serve``'s four processes, the
temporary Prefect API, the tests' Prefect, MLflow and PostgreSQL servers). Each runs in a process
group of its own (a Ctrl-C reaches the command, which stops them in order) and is SIGKILLed by the
kernel if the command that started it is killed (:mod:`tasks.shared.parent_death`): start it from a
thread that outlives it. Only the standard library at import: the temporary API is started
before anything else is imported.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from tasks.shared.parent_death import dying_with_this_process

T = TypeVar("T")
STOP_TIMEOUT_S = 10.0  # a server's clean shutdown; past it, SIGKILL


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the kernel's pick), for a server started next."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` different ports nobody listens on now, for a server that needs several.

    Each socket stays bound until all are picked, so the kernel cannot hand out one port twice.
    """
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


def port_free(host: str, port: int) -> bool:
    """True when a server could listen on ``host:port`` now.

    With SO_REUSEADDR, as servers bind: connections of a server that just stopped (TIME_WAIT)
    do not make its port look taken for a minute.
    """
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def start(
    args: list[str],
    log: Path,
    env: dict[str, str],
    cwd: Path | None = None,
    *,
    user: str | None = None,
    private: bool = False,
) -> subprocess.Popen[bytes]:
    """Start ``args`` in its own process group, its output appended to ``log``.

    ``private``: what it creates is its owner's alone (umask 077), for servers that keep state
    (databases, artifacts, volumes), whatever mode they ask for.
    ``user``: run it as that account (from root), for servers that refuse root (PostgreSQL).
    util-linux's ``setpriv`` switches to it and asks for the parent-death signal after the
    switch (a switch clears it); this Python and its wrapper may be private to root.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    command = dying_with_this_process(args)
    if user is not None:
        import pwd

        account = pwd.getpwnam(user)
        command = ["setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}",
                   "--clear-groups", "--pdeathsig", "KILL", "--", *args]  # fmt: skip
        env = env | {"HOME": account.pw_dir, "USER": user, "LOGNAME": user}
    with log.open("ab") as sink:
        return subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            umask=0o077 if private else -1,
        )


def healthy(url: str, timeout_s: float = 5.0) -> bool:
    """True when ``url`` answers 200; False when it answers otherwise or not at all.

    A fresh opener each time: ``urlopen`` keeps the proxies of the environment at its first call
    for the life of the process (torch.hub's downloads make that call too), so one call while a
    proxy was set would send every later check to it.
    """
    try:
        with urllib.request.build_opener().open(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_until(
    ready: Callable[[], T],
    timeout_s: float,
    interval_s: float,
    max_interval_s: float | None = None,
) -> T | None:
    """Call ``ready`` every ``interval_s`` until it returns something truthy, and return that;
    None once ``timeout_s`` has passed. It is called at least once; what it raises ends the wait.

    With ``max_interval_s`` the pause grows by half each time up to that: a check that costs a
    client and a server request (tens of ms of CPU each side) stays prompt for a short wait and
    does not take a tenth of a core through a training that lasts minutes.
    """
    import tenacity  # here: 60 ms to import, after the temporary API has started

    pause = (
        tenacity.wait_fixed(interval_s)
        if max_interval_s is None
        else tenacity.wait_exponential(
            multiplier=interval_s, exp_base=1.5, min=interval_s, max=max_interval_s
        )
    )
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_delay(timeout_s),
        wait=pause,
        retry=tenacity.retry_if_result(lambda result: not result),
        retry_error_callback=lambda _: None,
    )
    return retrying(ready)


def stop(process: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM ``process``'s group and wait for it; SIGKILL it after ``timeout_s``."""
    stop_together([process], timeout_s)


def stop_together(
    processes: list[subprocess.Popen],
    timeout_s: float = STOP_TIMEOUT_S,
    groups: Sequence[int] = (),
) -> list[int]:
    """SIGTERM every process's group at once, wait for them all, SIGKILL what is left after
    ``timeout_s``: a stop of several servers takes one timeout, not one each. Returns the
    groups that had to be SIGKILLed (a server that does not stop on SIGTERM in time).

    ``groups``: process groups whose leader has ended and was reaped (a restarted service's),
    whose other processes ran on; they get the same signals.
    """
    killed: list[int] = []
    for process in processes:
        with contextlib.suppress(ProcessLookupError):  # ended, and its group with it
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
    groups = [group for group in groups if group_alive(group)]
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            killed.append(process.pid)
            process.wait()
    while any(group_alive(group) for group in groups) and time.monotonic() < deadline:
        time.sleep(0.1)
    for group in groups:
        if group_alive(group):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
            killed.append(group)
    return killed


def group_alive(group: int) -> bool:
    """Whether process group ``group``, whose leader was reaped, still has a live process.

    A process whose pid is ``group`` is a new one (Linux reuses a pid only once no group has
    it as its id): the group is gone, and nothing is signalled. Zombies do not count.
    """
    import psutil

    if psutil.pid_exists(group):
        return False
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(process.pid) == group and process.status() != psutil.STATUS_ZOMBIE:
                return True
    return False


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Inside: SIGTERM and SIGINT raise KeyboardInterrupt, so a stop always runs its cleanup.

    SIGINT too: a shell that starts a command in the background makes it ignore SIGINT otherwise.
    """

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
