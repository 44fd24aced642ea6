"""Score Image Model's readers: images decoded and transformed in reader processes, a batch each.

Reader threads did not scale (issue 30: 16 threads decoded no faster than one, the transform's
per-image Python holding the GIL), so scoring reads as the training loader does: a torch
DataLoader whose loader processes come from the fork server, each making whole batches that it
stacks straight into shared memory. The session gets the batch as a numpy view of that memory: no
copy between the reader and ONNX Runtime. Readers die with the scoring process, even a SIGKILLed
one. Details: docs/scoring.md#readers.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from tasks.data.imagedir import ImageRefused, load_rgb
from tasks.data.transform import per_batch_steps
from tasks.inference.score.images import ImageRef
from tasks.shared import faults
from tasks.shared.fork_server import start_fork_server
from tasks.shared.parent_death import die_with

if TYPE_CHECKING:
    from torchvision.transforms import v2

# Batches read ahead by each reader process: two keep a reader busy while the session scores, and
# bound the shared memory in flight (readers x 2 batches; 38 MB per batch of 64 at 224 px).
BATCHES_AHEAD = 2


def reader_processes(cores: int) -> int:
    """Reader processes beside a session that runs ``cores`` ONNX Runtime threads: one per core.

    Enough to decode as fast as the cores allow where decoding costs as much as the model (small
    images); a reader whose batches are ahead sleeps, leaving its core to ONNX Runtime. A rule,
    not a timing taken at run time; ``bench.score_speed`` measures the ratio it gives
    (docs/benchmarks.md, "Readers that scale").
    """
    return max(1, cores)


def read_image(ref: ImageRef, transform: Callable) -> tuple[np.ndarray | None, str]:
    """One image as the network takes it, or None and the reason it cannot be read."""
    if ref.problem:
        return None, ref.problem
    faults.point("score.image_read")
    try:
        return transform(load_rgb(ref.source())).numpy(), ""
    except ImageRefused as refused:  # over the limits convert applies too
        return None, refused.reason
    except Exception as exc:  # one bad file must not sink the other images
        return None, f"{type(exc).__name__}: {exc}"


class _BatchReader(Dataset):
    """``reader[refs]``: one batch read, (the readable images stacked, each image's error).

    Keyed by the batch's refs themselves, not an index into a list: a reader process holds only
    the transform, never a copy of every image's name, so its memory does not grow with the
    images either. Each image gets the transform's own steps; the closing dtype and
    normalisation run once on the stacked batch (tasks.data.transform.per_batch_steps), whose
    result a reader process puts in shared memory for the scoring process to read in place.
    """

    def __init__(self, transform: v2.Compose) -> None:
        self.per_image, self.per_batch = per_batch_steps(transform)

    def __getitem__(self, refs: list[ImageRef]) -> tuple[torch.Tensor | None, list[str]]:
        read = [read_image(ref, self.per_image) for ref in refs]
        tensors = [torch.from_numpy(tensor) for tensor, _ in read if tensor is not None]
        errors = [error for _, error in read]
        if not tensors:
            return None, errors
        stacked = self.per_batch(torch.stack(tensors))
        if get_worker_info() is not None:  # in a reader process: hand it over without a copy
            stacked.share_memory_()
        return stacked, errors


def _as_read(batch: tuple[torch.Tensor | None, list[str]]) -> tuple[torch.Tensor | None, list]:
    """The collate of a loader fed whole batches: each is already one."""
    return batch


def _reader_started(scorer: int, environment: dict[str, str], cwd: str, worker_id: int) -> None:
    """``worker_init_fn`` of every reader process: it ends when the scoring process ends, reads
    with the scoring process's environment and folder, not the fork server's (started earlier,
    maybe before the S3 keys or the project were set: its readers found no credentials), and
    leaves the imported objects out of garbage collection."""
    die_with(scorer)
    os.environ.clear()
    os.environ.update(environment)
    # The objects the fork server imported (torch's among them) are never garbage: left in the
    # collector's care, its first full collection walked them all, 0.2-0.26 s of each reader's CPU
    # (1.19 -> 0.93 ms an image at 64 px, 2 readers, 1,797 images, 6 rounds interleaved).
    gc.freeze()
    os.chdir(cwd)


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """torch computes each transform step on one thread while this process reads, as before
    after: the readers are the parallelism, and the session's threads need the cores. (Reader
    processes are given one thread by the DataLoader itself.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _main_module_left_out() -> Iterator[None]:
    """Reader processes start without importing the caller's ``__main__`` again.

    multiprocessing prepares a fork server's child as a spawned one: it imports the parent's main
    script (or module) anew, running its top level. A script calling score() without
    ``if __name__ == "__main__":`` then scored again in every reader and failed with
    "DataLoader worker exited unexpectedly"; a Prefect flow run's readers imported Prefect's
    engine. Readers need nothing from it (the dataset and transform are ours), so while they start
    the main module shows neither a file nor a module name to import.
    """
    main = sys.modules["__main__"]
    kept = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(kept)


@contextlib.contextmanager
def read_batches(
    refs: list[ImageRef],
    size: int,
    transform: v2.Compose,
    readers: int,
) -> Iterator[Iterator[tuple[int, list[ImageRef], np.ndarray | None, list[int], list[str]]]]:
    """The batches, read: each one (its start, its refs, its readable images as one float array
    or None, the places in the batch they come from, each image's error), in the images' order.

    ``readers`` processes read the next batches while the caller scores this one (0: this process
    reads each batch when asked, nothing ahead). They start on entering, so they decode the first
    batches while the caller still makes its session (at 64 px their start was 9% of a 1,797-image
    run), and end on leaving: done, or stopped early (an error, Ctrl-C). At most
    ``readers * BATCHES_AHEAD`` batches are in flight, whatever the number of images. An image
    that cannot be read gets its reason instead of a place in the array.
    """
    batches = [refs[start : start + size] for start in range(0, len(refs), size)]
    options: dict = {}
    if readers > 0:
        options = {
            "num_workers": readers,
            "prefetch_factor": BATCHES_AHEAD,
            "multiprocessing_context": start_fork_server(),
            "worker_init_fn": partial(_reader_started, os.getpid(), dict(os.environ), os.getcwd()),
        }
    loader = DataLoader(
        _BatchReader(transform), batch_size=None, sampler=batches, collate_fn=_as_read, **options
    )
    with _one_torch_thread():
        with _main_module_left_out():
            read = iter(loader)  # the reader processes start here
        try:
            yield _in_order(batches, read)
        finally:
            shutdown = getattr(read, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()


def _in_order(
    batches: list[list[ImageRef]], read: Iterator[tuple[torch.Tensor | None, list[str]]]
) -> Iterator[tuple[int, list[ImageRef], np.ndarray | None, list[int], list[str]]]:
    start = 0
    for batch, (stacked, errors) in zip(batches, read, strict=True):
        kept = [i for i, error in enumerate(errors) if not error]
        yield start, batch, None if stacked is None else stacked.numpy(), kept, errors
        start += len(batch)
