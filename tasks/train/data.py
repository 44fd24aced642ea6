"""Training and validation data: torchvision's ImageFolder, held to the ImageDirectory manifest.

The manifest is the source of truth: class ids come from its class list (so a class that has no
image in this half of a split keeps its id), and only the files it lists are read, so a stray
file dropped into the folder later is not trained on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from torch.utils.data import Sampler
from torchvision.datasets import ImageFolder

from tasks.errors import InvalidImageDirectoryError
from tasks.imagedir import Manifest, load_rgb


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
