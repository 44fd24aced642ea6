"""Checking every planned file, in parallel on all cores when the input is big enough to gain."""

from __future__ import annotations

import itertools
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


def processes(count: int, jobs: Callable[[int, int], list[CheckJob]], workers: int | None) -> int:
    """How many processes check ``count`` files (this one included): 1 below the pool's size
    thresholds, else ``workers`` (default: every core)."""
    if count < MIN_FILES_FOR_POOL:
        return 1
    if workers is None:
        step = 256
        sizes = (_size(job) for i in range(0, count, step) for job in jobs(i, min(count, i + step)))
        if sum(sizes) < MIN_BYTES_FOR_POOL:
            return 1
        workers = available_cores()
    return max(1, min(workers, count))


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


class _Chunk:
    """A chunk of jobs, its place, and who checks it: a worker (``future``) or this process."""

    def __init__(
        self, stripe: int, start: int, jobs: list[CheckJob], future: Future[list[CheckResult]]
    ) -> None:
        self.stripe, self.start, self.jobs = stripe, start, jobs
        self.future: Future[list[CheckResult]] | None = future
        self.results: list[CheckResult] | None = None

    def take_over(self, advance: Callable[[int], None]) -> bool:
        """Check the chunk here if no worker has started it; whether this process did."""
        if self.future is None or not self.future.cancel():
            return False
        self.future = None
        self.results = [_advanced(advance, check_file(job)) for job in self.jobs]
        return True

    def result(self) -> list[CheckResult]:
        return self.results if self.future is None else self.future.result()  # type: ignore[return-value]


def stripe_bounds(count: int, stripes: int) -> list[int]:
    """Where each stripe of ``count`` files starts, and the end: ``stripes`` equal parts."""
    return [count * i // stripes for i in range(stripes + 1)]


def check_in_order(
    count: int, jobs: Callable[[int, int], list[CheckJob]], processes: int
) -> Iterator[tuple[int, int, list[CheckResult]]]:
    """:func:`check_file` on each of ``count`` jobs in ``processes`` processes (this one
    included): ``(stripe, start, results)`` per chunk of jobs from ``start``. ``jobs(start,
    stop)`` makes the jobs of that slice.

    The jobs are cut into as many stripes as processes (:func:`stripe_bounds`), and each stripe
    into chunks, handed out a stripe at a time in turn: processes checking side by side work in
    different stripes, far apart in the input. (Neighbouring files, checked side by side,
    cost 40% more system time on a 2-core machine: the kernel serialises the work in one
    folder.) Each stripe's chunks come back in order. Chunks are made and sent a window ahead
    of the one being taken, so the jobs and results of a million files are never in memory at
    once. This process is one of the ``processes``: while the chunk it needs next is still
    being checked, it checks a chunk from the back of the window that no worker has started,
    of another stripe than the workers', so the work starts at once instead of after an
    interpreter start-up, and it never waits idle. Spawn, never fork: forking a process that
    runs Prefect's threads can deadlock the child.
    """
    with _progress(count) as advance:
        if processes <= 1:
            for start in range(0, count, 256):
                chunk = jobs(start, min(count, start + 256))
                yield 0, start, [_advanced(advance, check_file(job)) for job in chunk]
            return
        bounds = stripe_bounds(count, processes)
        # Chunks amortise the round trip per file, and stay small enough to balance the load.
        size = max(1, min(32, count // (processes * 4)))
        starts = [range(bounds[i], bounds[i + 1], size) for i in range(processes)]
        order = [
            (stripe, start)
            for group in itertools.zip_longest(*starts)
            for stripe, start in enumerate(group)
            if start is not None
        ]
        ahead = processes * 16
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            max_workers=processes - 1,
            mp_context=context,
            initializer=die_with_parent,  # a SIGKILLed convert leaves no worker behind
            initargs=(os.getpid(),),
        ) as pool:
            pending: deque[_Chunk] = deque()
            try:
                for stripe, start in order:
                    chunk = jobs(start, min(bounds[stripe + 1], start + size))
                    future = pool.submit(check_files, chunk)
                    future.add_done_callback(partial(_chunk_done, advance, len(chunk)))
                    pending.append(_Chunk(stripe, start, chunk, future))
                    if len(pending) >= ahead:
                        yield _take(pending, advance)
                while pending:
                    yield _take(pending, advance)
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # not the whole queue first
                raise


def _take(
    pending: deque[_Chunk], advance: Callable[[int], None]
) -> tuple[int, int, list[CheckResult]]:
    """The first chunk's place and results. While a worker still checks it, this process takes
    over chunks from the back of the window, of a stripe no worker is in if it can."""
    first = pending[0]
    while first.future is not None and not first.future.done():
        busy = {c.stripe for c in pending if c.future is not None and c.future.running()}
        candidates = [c for c in reversed(pending) if c.stripe not in busy]
        candidates += [c for c in reversed(pending) if c.stripe in busy]
        if not any(chunk.take_over(advance) for chunk in candidates):
            break  # every chunk is started: wait for the first
    chunk = pending.popleft()
    return chunk.stripe, chunk.start, chunk.result()


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
