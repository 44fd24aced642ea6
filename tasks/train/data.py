"""Training and validation data: torchvision's ImageFolder, held to the ImageDirectory manifest,
and the DataLoaders that keep the model fed.

The manifest is the source of truth (class ids, the files read). Augmentation draws from a seed
per (run seed, epoch, image) (:class:`SeededSampler`), so the data trained on does not depend on
loader processes or restarts. Details: docs/training.md#data-and-loaders.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

from tasks.data.imagedir import Manifest, load_rgb
from tasks.shared.errors import InvalidImageDirectoryError
from tasks.shared.fork_server import start_fork_server
from tasks.shared.parent_death import die_with
from tasks.train.loop import derive_seed

# Batches the loader processes of one loader prepare ahead, together: enough to ride out a slow
# image, spread over the processes (at least PyTorch's 2 each, so none ever waits for work). A
# fixed total, not a fixed number per process, bounds the shared memory the batches in flight hold
# (a float batch of 128 images at 224 px is 77 MB) whatever the core count.
BATCHES_AHEAD = 16
MIN_PREFETCH_FACTOR = 2


class ManifestImageFolder(ImageFolder):
    """ImageFolder over an ImageDirectory root, with the manifest's classes and files."""

    def __init__(self, root: Path, manifest: Manifest, transform: Callable | None = None) -> None:
        root = Path(root)
        self.manifest = manifest
        listed = {entry.path for entry in manifest.images}
        super().__init__(
            str(root),
            transform=transform,
            loader=load_rgb,
            is_valid_file=lambda p: Path(p).relative_to(root).as_posix() in listed,
            allow_empty=True,  # a tiny split may leave a class with no image on one side
        )
        expected = {c: i for i, c in enumerate(manifest.classes)}
        if self.class_to_idx != expected:
            raise InvalidImageDirectoryError(
                f"{root}: class ids {self.class_to_idx} differ from the manifest's {expected}.",
                "Re-create the directory with `imageops convert`.",
            )
        found = {Path(p).relative_to(root).as_posix(): label for p, label in self.samples}
        wanted = {e.path: e.label for e in manifest.images}
        if found != wanted:
            missing = sorted(set(wanted) - set(found))
            relabeled = sorted(p for p in set(found) & set(wanted) if found[p] != wanted[p])
            raise InvalidImageDirectoryError(
                f"{root} no longer matches its manifest (missing: {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}; moved to another class: {relabeled[:5]}).",
                "Re-create the directory with `imageops convert` (or restore it with `dvc pull`).",
            )

    def find_classes(self, directory: str | Path) -> tuple[list[str], dict[str, int]]:
        """The manifest's classes; a class folder on disk that it does not list is an error."""
        on_disk = {p.name for p in Path(directory).iterdir() if p.is_dir()}
        # Hidden folders (.ipynb_checkpoints, ...) are tools' litter, not classes.
        unknown = sorted(n for n in on_disk - set(self.manifest.classes) if not n.startswith("."))
        if unknown:
            raise InvalidImageDirectoryError(
                f"{directory} has class folders its manifest does not list: {unknown}.",
                "Re-create the directory with `imageops convert`.",
            )
        classes = list(self.manifest.classes)
        return classes, {c: i for i, c in enumerate(classes)}


class ShardSampler(Sampler[int]):
    """Every ``world_size``-th index from ``rank``: each validation image is seen exactly once.

    DistributedSampler pads the last shard with repeats so all ranks do the same number of steps,
    which training needs (DDP all-reduces every step) but which would count some validation images
    twice. Evaluation runs on the unwrapped model, so uneven shards are safe there.
    """

    def __init__(self, length: int, rank: int, world_size: int) -> None:
        self.indices = list(range(rank, length, world_size))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class SeededSampler(Sampler[tuple[int, int]]):
    """The indices of a DistributedSampler, each with the seed its augmentation draws from.

    The seed depends on (run seed, epoch, index) only: the sampler runs in the training process,
    where ``set_epoch`` is called, so even persistent loader processes, which keep the dataset
    copy they started with, get each epoch's seeds.
    """

    def __init__(self, sampler: DistributedSampler, seed: int) -> None:
        self.sampler = sampler
        self.seed = seed

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.sampler.epoch
        for index in self.sampler:
            yield index, derive_seed(self.seed, "augment", epoch, index)

    def __len__(self) -> int:
        return len(self.sampler)


class SeededDataset(Dataset):
    """``dataset[index]`` with torch's random state seeded by the seed that comes with the index.

    torchvision's random transforms draw from torch's default CPU generator; seeding it per image
    (and restoring it after, so the caller's stream is untouched) makes each image's augmentation
    a function of its seed alone. The generator is handled directly: ``torch.manual_seed`` and
    ``fork_rng`` also visit every accelerator's generators and cost 40x more (0.1 ms an image).
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        assert isinstance(self.dataset, Sized)
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        generator = torch.default_generator
        state = generator.get_state()
        generator.manual_seed(seed)
        try:
            return self.dataset[index]
        finally:
            generator.set_state(state)


def loader_workers(device: torch.device, requested: int | None) -> int:
    """Loader processes per training process: ``requested``, or the default for ``device``.

    CPU: 0, since the step needs every core and costs far more than decoding. CUDA: each of this
    process's share of cores but one, since a GPU trains faster than one core decodes.
    Details: docs/training.md#loader_workers-how-many-loader-processes.
    """
    if requested is not None:
        return requested
    if device.type != "cuda":
        return 0
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(0, (cores or 1) // per_node - 1)


def prefetch_factor(num_workers: int) -> int:
    """Batches each of ``num_workers`` loader processes prepares ahead (BATCHES_AHEAD in all)."""
    return max(MIN_PREFETCH_FACTOR, -(-BATCHES_AHEAD // max(num_workers, 1)))


def _loader_started(trainer: int, worker_id: int) -> None:
    """``worker_init_fn`` of every loader process: it ends when its training process ends."""
    die_with(trainer)


class PreparedLoader(DataLoader):
    """A DataLoader whose persistent loader processes can start on its next pass before it is
    asked for: :meth:`prepare`, then iterate as usual.

    The training worker prepares both loaders before DDP and its MLflow record start, so the first
    batches are made meanwhile instead of opening the first epoch (issue 30). Details:
    docs/training.md#preparedloader-and-runaheadloader.
    """

    _ahead: int | None = None  # the pass (the sampler's epoch; 0 without one) being prepared

    def _runs_ahead(self) -> bool:
        return bool(self.persistent_workers and self.num_workers > 0)

    def _pass(self) -> int:
        return int(getattr(self.sampler, "epoch", 0))

    def prepare(self, epoch: int | None = None) -> None:
        """Start making the next pass's batches now (``epoch``: set the sampler's first).

        Without loader processes this does nothing: a pass then loads as it is asked.
        """
        if not self._runs_ahead():
            return
        if epoch is not None:
            self.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        if self._ahead != self._pass():
            super().__iter__()  # starts (or resumes) the persistent loader processes
            self._ahead = self._pass()

    def __iter__(self) -> Iterator[Any]:
        if not self._runs_ahead():
            return super().__iter__()
        return self._one_pass()

    def _one_pass(self) -> Iterator[Any]:
        current = self._pass()
        iterator = self._iterator if self._ahead == current else None
        self._ahead = None
        yield from iterator if iterator is not None else super().__iter__()
        self._after_pass(current)

    def _after_pass(self, finished: int) -> None:
        """What to do once a whole pass was handed out: nothing here."""


class RunAheadLoader(PreparedLoader):
    """A training loader whose persistent loader processes start on the next epoch's batches as
    soon as the last batch of this one is handed out, while the model validates and saves.

    This removes the wait that opened each epoch (0.3 s on an H100); the images stay the same, as
    augmentation depends on (seed, epoch, index) only. Details:
    docs/training.md#preparedloader-and-runaheadloader.
    """

    def _after_pass(self, finished: int) -> None:
        assert isinstance(self.sampler, SeededSampler)
        self.prepare(finished + 1)


class DeviceFinish:
    """The last two steps of an image transform, to float and normalise, run on a whole batch.

    Loader processes then hand over uint8 images, 4x fewer bytes than float32 to write into shared
    memory, copy into pinned memory and send to the GPU, and skip the two steps' arithmetic; the
    GPU does it for the batch in microseconds, with torchvision's own functions, so the values are
    the ones the loader processes would have made.
    """

    def __init__(self, to_float: v2.ToDtype, normalize: v2.Normalize) -> None:
        self.dtype = to_float.dtype
        self.mean, self.std = list(normalize.mean), list(normalize.std)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        images = v2.functional.to_dtype(images, self.dtype, scale=True)
        return v2.functional.normalize(images, self.mean, self.std)


def split_finish(dataset: Dataset) -> tuple[Dataset, DeviceFinish | None]:
    """``dataset`` without its transform's final to-float and normalise steps, and those steps.

    Looks through :class:`SeededDataset` and ``Subset`` to the dataset with the transform, and
    copies (shallowly) what it changes: the caller's dataset still makes float images. A transform
    that does something after normalising (random erasing) is left whole: (dataset, None).
    """
    if isinstance(dataset, SeededDataset | Subset):
        inner, finish = split_finish(dataset.dataset)
        if finish is None:
            return dataset, None
        outer = copy.copy(dataset)
        outer.dataset = inner
        return outer, finish
    transform = getattr(dataset, "transform", None)
    steps = transform.transforms if isinstance(transform, v2.Compose) else []
    if (
        len(steps) >= 2
        and isinstance(steps[-2], v2.ToDtype)
        and steps[-2].scale
        and isinstance(steps[-2].dtype, torch.dtype)
        and steps[-2].dtype.is_floating_point
        and isinstance(steps[-1], v2.Normalize)
    ):
        trimmed = copy.copy(dataset)
        trimmed.transform = v2.Compose(steps[:-2])  # type: ignore[attr-defined]
        return trimmed, DeviceFinish(steps[-2], steps[-1])
    return dataset, None


@dataclass(frozen=True)
class LoaderSetup:
    """How this process's loaders are made: the same for its training and validation loaders."""

    device: torch.device
    num_workers: int  # loader processes (:func:`loader_workers`); 0: load in this process
    finish_on_device: bool | None = None  # default: on CUDA (see :func:`make_loader`)


def make_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    sampler: Sampler,
    setup: LoaderSetup,
    drop_last: bool = False,
    run_ahead: bool = False,
) -> PreparedLoader:
    """A DataLoader that keeps the model fed, safely inside a multi-threaded training process.

    Loader processes come from the one fork server (:mod:`tasks.shared.fork_server`), persist across
    epochs and run ``BATCHES_AHEAD`` batches ahead; on CUDA batches are pinned uint8, normalised on
    the GPU (the loader's ``finish_on_device``). A :class:`PreparedLoader`; ``run_ahead``: a
    :class:`RunAheadLoader`.
    Details: docs/training.md#make_loader.
    """
    device, num_workers, finish_on_device = setup.device, setup.num_workers, setup.finish_on_device
    if finish_on_device is None:
        finish_on_device = device.type == "cuda"
    finish = None
    if finish_on_device:
        dataset, finish = split_finish(dataset)
    options: dict[str, Any] = {"pin_memory": device.type == "cuda"}
    if num_workers > 0:
        options |= {
            "num_workers": num_workers,
            "multiprocessing_context": start_fork_server(),
            "persistent_workers": True,
            "prefetch_factor": prefetch_factor(num_workers),
            # Killed with this process, however it ends (a SIGKILL stops no loader itself).
            "worker_init_fn": partial(_loader_started, os.getpid()),
        }
    kind = RunAheadLoader if run_ahead else PreparedLoader
    loader = kind(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **options)
    loader.finish_on_device = finish  # type: ignore[attr-defined]
    return loader


def training_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    setup: LoaderSetup,
) -> tuple[PreparedLoader, SeededSampler]:
    """The training loader of one rank: its shard, reshuffled per epoch, augmented per image.

    Call ``sampler.set_epoch(epoch)`` before each epoch. Returns (loader, sampler).
    """
    assert isinstance(dataset, Sized)
    shard = DistributedSampler(
        dataset,
        num_replicas=world_size,
        rank=rank,
        shuffle=True,
        seed=derive_seed(seed, "shuffle"),
        drop_last=False,
    )
    sampler = SeededSampler(shard, seed)
    per_rank = len(shard)
    loader = make_loader(
        SeededDataset(dataset),
        batch_size=batch_size,
        sampler=sampler,
        setup=setup,
        run_ahead=True,
        # A last batch of one image breaks BatchNorm in training mode (one value per channel
        # after the final pooling): drop exactly that case, never a real batch.
        drop_last=per_rank > batch_size and per_rank % batch_size == 1,
    )
    return loader, sampler
