"""Child processes die with the process that started them, even when it is SIGKILLed.

A SIGKILLed command runs no cleanup, so its pools, torchrun and servers would run on, holding
memory, GPUs and ports. Each child asks Linux itself (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) to be
killed when its parent ends, and dies at once if the parent is already gone. Linux only
(elsewhere no-ops). Who calls what, and the caveats: docs/internals.md#parent-death.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# The pid of the program dying_with_this_process started: its own children (torchrun's workers)
# check that it is still their parent once they have asked to die with it.
PARENT_PID = "IMAGEOPS_PDEATHSIG_PARENT"


def die_with_parent(parent_pid: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent ends; die now if it already has.

    ``parent_pid`` is the parent this process was started by: if this process has another parent
    already (the first one died before this call), it kills itself at once.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno)}")
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def die_with(pid: int) -> None:
    """SIGKILL this process when process ``pid`` ends, ``pid`` being another than its parent.

    For a DataLoader's loader processes: they are forked by the fork server, not by the training
    process they serve, and the fork server outlives a SIGKILLed training process as long as a
    loader process lives (each holds the server's "alive" pipe), while each loader process waits
    for its parent, the server, to die: neither would ever end. A thread here waits on a pidfd
    of ``pid`` (readable once it has ended). Linux 5.3 and later; elsewhere a no-op.
    """
    if not hasattr(os, "pidfd_open"):
        return
    try:
        # ``pid`` asked for this process a moment ago: alive still, or dead so recently that its
        # pid is not another process's yet (Linux hands out pids in turn, wrapping at the end).
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # ended already
        os.kill(os.getpid(), signal.SIGKILL)
        return
    except OSError:  # a kernel without pidfds
        return
    threading.Thread(target=_die_when_readable, args=(fd,), name="die-with", daemon=True).start()


def _die_when_readable(fd: int) -> None:
    select.select([fd], [], [])
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_torchrun() -> None:
    """For torchrun's workers: die when the torchrun that :func:`dying_with_this_process` ran dies.

    A worker started some other way (no ``IMAGEOPS_PDEATHSIG_PARENT``) is left as it is.
    """
    parent = os.environ.pop(PARENT_PID, None)  # for this process only, not for its children
    if parent:
        die_with_parent(int(parent))


def dying_with_this_process(command: list[str]) -> list[str]:
    """``command`` prefixed so that the program it runs is SIGKILLed when this process ends.

    Start it from a thread that waits for it (see the module's caveats). The program finds its
    own pid in ``IMAGEOPS_PDEATHSIG_PARENT`` (for :func:`die_with_torchrun` in its children).
    """
    if not sys.platform.startswith("linux"):
        return list(command)
    # This file as a script, isolated (-I: no script folder, PYTHON* variables or user site on
    # sys.path) and without site (-S): it needs the standard library only, whatever the
    # command's environment and working folder, and starts in milliseconds.
    script = os.path.abspath(__file__)
    return [sys.executable, "-I", "-S", script, str(os.getpid()), "--", *command]


def _exec(argv: list[str]) -> None:
    """``PARENT_PID -- COMMAND...``: set the parent-death signal, then become COMMAND."""
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -I -S tasks/shared/parent_death.py PARENT_PID -- COMMAND [ARG...]")
    die_with_parent(int(argv[0]))
    os.environ[PARENT_PID] = str(os.getpid())  # exec keeps the pid: the program's own
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    _exec(sys.argv[1:])
