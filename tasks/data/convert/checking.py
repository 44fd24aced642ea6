"""Checking every planned file, in parallel on all cores when the input is big enough to gain."""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from contextlib import contextmanager
from functools import partial
from typing import TypeVar

from tasks.data.imagecheck import CheckJob, CheckResult, check_file, check_files, refused_unread
from tasks.shared.parent_death import die_with_parent

# Starting a process pool costs about a second (each worker is a fresh interpreter), while checking
# a small image takes well under a millisecond: below these sizes the pool costs more than it saves.
# An explicit ``workers`` skips the byte rule (the caller asked for processes).
MIN_FILES_FOR_POOL = 64
MIN_BYTES_FOR_POOL = 16 * 1024**2

T = TypeVar("T")
R = TypeVar("R")


def available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))  # respects taskset and container CPU sets
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def _use_pool(jobs: Iterable[CheckJob], count: int, workers: int | None) -> int:
    """How many worker processes to start; 0 or 1 means check in this process."""
    if count < MIN_FILES_FOR_POOL:
        return 0
    if workers is None:
        if sum(_size(job) for job in jobs) < MIN_BYTES_FOR_POOL:
            return 0
        workers = available_cores()
    return min(workers, count)


def _size(job: CheckJob) -> int:
    """The bytes checking ``job`` reads: none for a file refused by its extension or size."""
    try:
        size = os.path.getsize(job.source)
    except OSError:
        return 0
    return 0 if refused_unread(job.rel, size, job.max_pixels) else size


def ordered_map(pool: Executor, fn: Callable[[T], R], args: Iterable[T], ahead: int) -> Iterator[R]:
    """``pool.map(fn, args)`` with at most ``ahead`` calls submitted and not yet taken: the
    results come in order and memory holds a window of them, never all (``Executor.map``
    submits every call at once)."""
    pending: deque[Future[R]] = deque()
    for arg in args:
        pending.append(pool.submit(fn, arg))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


class _Own:
    """A chunk this process checks itself, when its turn comes or while it waits for a worker."""

    def __init__(self, jobs: list[CheckJob]) -> None:
        self.jobs = jobs
        self.results: list[CheckResult] | None = None

    def run(self, advance: Callable[[int], None]) -> list[CheckResult]:
        if self.results is None:
            self.results = [_advanced(advance, check_file(job)) for job in self.jobs]
        return self.results


def check_in_order(
    count: int, jobs: Callable[[int, int], list[CheckJob]], workers: int | None
) -> Iterator[CheckResult]:
    """:func:`check_file` on each of ``count`` jobs, results in job order, in a process pool
    unless the input is small. ``jobs(start, stop)`` makes the jobs of that slice.

    This process is one of the ``workers``: it checks every ``workers``-th chunk itself, and
    while it waits for a worker's chunk it checks its own later ones, so the work starts at once
    instead of after an interpreter start-up (a tenth of a second per spawned worker). Chunks
    are made and sent a window ahead of the one being taken: the jobs and results of a million
    files are never in memory at once. Spawn, never fork: forking a process that runs Prefect's
    threads can deadlock the child. The order does not depend on scheduling.
    """
    sizing = (job for start in range(0, count, 256) for job in jobs(start, min(count, start + 256)))
    workers = _use_pool(sizing, count, workers)
    with _progress(count) as advance:
        if workers <= 1:
            for start in range(0, count, 256):
                for job in jobs(start, min(count, start + 256)):
                    yield _advanced(advance, check_file(job))
            return
        # Chunks amortise the round trip per file, and stay small enough to balance the load.
        size = max(1, min(32, count // (workers * 4)))
        ahead = workers * 16
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            max_workers=workers - 1,
            mp_context=context,
            initializer=die_with_parent,  # a SIGKILLed convert leaves no worker behind
            initargs=(os.getpid(),),
        ) as pool:
            pending: deque[Future[list[CheckResult]] | _Own] = deque()
            try:
                for index, start in enumerate(range(0, count, size)):
                    chunk = jobs(start, min(count, start + size))
                    if index % workers == workers - 1:
                        pending.append(_Own(chunk))
                    else:
                        future = pool.submit(check_files, chunk)
                        future.add_done_callback(partial(_chunk_done, advance, len(chunk)))
                        pending.append(future)
                    if len(pending) >= ahead:
                        yield from _take(pending, advance)
                while pending:
                    yield from _take(pending, advance)
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # not the whole queue first
                raise


def _take(
    pending: deque[Future[list[CheckResult]] | _Own], advance: Callable[[int], None]
) -> list[CheckResult]:
    """The first pending chunk's results; while a worker still has it, own chunks are checked."""
    first = pending[0]
    if isinstance(first, Future):
        while not first.done():
            own = next((p for p in pending if isinstance(p, _Own) and p.results is None), None)
            if own is None:
                break
            own.run(advance)
    pending.popleft()
    return first.result() if isinstance(first, Future) else first.run(advance)


def _chunk_done(advance: Callable[[int], None], n: int, future: Future) -> None:
    if not future.cancelled():  # a chunk this process took over counts as it goes
        advance(n)


def _advanced(advance: Callable[[int], None], result: CheckResult) -> CheckResult:
    advance(1)
    return result


@contextmanager
def _progress(total: int) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on a terminal; nothing in logs, CI or a Prefect worker.

    Yields ``advance(n)``, safe to call from any thread.
    """
    if not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("Checking images", total=total)
        yield lambda n: bar.advance(task, n)
