"""Checking every planned file, in parallel on all cores when the input is big enough to gain."""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from functools import partial

from tasks.data.imagecheck import CheckJob, CheckResult, check_file, check_files, refused_unread
from tasks.shared.parent_death import die_with_parent

# Starting a process pool costs about a second (each worker is a fresh interpreter), while checking
# a small image takes well under a millisecond: below these sizes the pool costs more than it saves.
# An explicit ``workers`` skips the byte rule (the caller asked for processes).
MIN_FILES_FOR_POOL = 64
MIN_BYTES_FOR_POOL = 16 * 1024**2


def available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))  # respects taskset and container CPU sets
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def _use_pool(jobs: list[CheckJob], workers: int | None) -> int:
    """How many worker processes to start; 0 or 1 means check in this process."""
    if len(jobs) < MIN_FILES_FOR_POOL:
        return 0
    if workers is None:
        if sum(_size(job) for job in jobs) < MIN_BYTES_FOR_POOL:
            return 0
        workers = available_cores()
    return min(workers, len(jobs))


def _size(job: CheckJob) -> int:
    """The bytes checking ``job`` reads: none for a file refused by its extension or size."""
    try:
        size = os.path.getsize(job.source)
    except OSError:
        return 0
    return 0 if refused_unread(job.rel, size, job.max_pixels) else size


def check_all(jobs: list[CheckJob], workers: int | None) -> list[CheckResult]:
    """Run :func:`check_file` on every job, in a process pool unless the input is small.

    This process is one of the ``workers``: the others are spawned and take chunks of jobs from
    the front while this one checks chunks from the back, so the work starts at once instead of
    after an interpreter start-up (a tenth of a second per spawned worker). Spawn, never fork:
    forking a process that runs Prefect's threads can deadlock the child. Results come back in
    job order, so the manifest does not depend on scheduling.
    """
    workers = _use_pool(jobs, workers)
    with _progress(len(jobs)) as advance:
        if workers <= 1:
            return [_advanced(advance, check_file(job)) for job in jobs]
        # Chunks amortise the round trip per file, and stay small enough to balance the load.
        size = max(1, min(32, len(jobs) // (workers * 4)))
        chunks = [jobs[i : i + size] for i in range(0, len(jobs), size)]
        mine: dict[int, list[CheckResult]] = {}
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            max_workers=workers - 1,
            mp_context=context,
            initializer=die_with_parent,  # a SIGKILLed convert leaves no worker behind
            initargs=(os.getpid(),),
        ) as pool:
            try:
                futures = [pool.submit(check_files, chunk) for chunk in chunks]
                for future, chunk in zip(futures, chunks, strict=True):
                    future.add_done_callback(partial(_chunk_done, advance, len(chunk)))
                for i in reversed(range(len(chunks))):
                    if not futures[i].cancel():
                        break  # a worker has this chunk already: the ones before are theirs too
                    mine[i] = [_advanced(advance, check_file(job)) for job in chunks[i]]
                return [
                    result
                    for i, future in enumerate(futures)
                    for result in (mine[i] if i in mine else future.result())
                ]
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # not the whole queue first
                raise


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
