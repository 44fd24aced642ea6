"""Split Image Directory: one ImageDirectory becomes two, stratified by class and seeded.

The fraction goes to the first output (rounded down per class, so every class keeps its share);
the same seed and input always give the same split. Both outputs keep the full class list, so
their class ids agree.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np

from models.atomic import atomic_directory
from tasks.errors import InvalidParameterError
from tasks.imagedir import ImageEntry, Manifest, read_manifest, write_manifest
from tasks.step import step


def _write_subset(source: Path, dest: Path, manifest: Manifest, entries: list[ImageEntry]) -> Manifest:
    counts = {c: sum(1 for e in entries if e.label == i) for i, c in enumerate(manifest.classes)}
    subset = manifest.model_copy(
        update={"images": entries, "counts": counts, "source": str(source.resolve()), "skipped": []}
    )
    with atomic_directory(dest) as tmp:
        for entry in entries:
            target = tmp / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / entry.path, target)
        write_manifest(tmp, subset)
    return subset


def split(
    source: Path, first: Path, second: Path, *, fraction: float = 0.9, seed: int = 1
) -> tuple[Manifest, Manifest]:
    """Split ``source`` into ``first`` (``fraction`` of each class) and ``second`` (the rest)."""
    if not 0.0 <= fraction <= 1.0:
        raise InvalidParameterError(
            f"fraction must be between 0 and 1, got {fraction}.", "Use e.g. 0.9 for a 90/10 split."
        )
    source = Path(source)
    manifest = read_manifest(source)
    rng = np.random.default_rng(seed)
    groups: dict[int | None, list[ImageEntry]] = {}
    for entry in manifest.images:
        groups.setdefault(entry.label, []).append(entry)
    chosen: list[ImageEntry] = []
    rest: list[ImageEntry] = []
    for label in sorted(groups, key=lambda x: -1 if x is None else x):
        entries = sorted(groups[label], key=lambda e: e.path)
        order = rng.permutation(len(entries))
        cut = math.floor(fraction * len(entries))
        chosen += [entries[i] for i in sorted(order[:cut])]
        rest += [entries[i] for i in sorted(order[cut:])]
    return (
        _write_subset(source, Path(first), manifest, chosen),
        _write_subset(source, Path(second), manifest, rest),
    )


split_task = step(split, name="split")
