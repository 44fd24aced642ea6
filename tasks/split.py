"""Split Image Directory: one ImageDirectory becomes two, stratified by class and seeded.

The fraction goes to the first output (rounded down per class, so every class keeps its share);
the same seed and input always give the same split. Both outputs keep the full class list, so
their class ids agree. An unlabeled directory is split the same way, as one group.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np

from models.atomic import atomic_directory
from tasks.errors import InvalidParameterError
from tasks.imagedir import ImageEntry, Manifest, find_duplicates, read_manifest, write_manifest
from tasks.step import step


def _write_subset(
    source: Path, dest: Path, manifest: Manifest, entries: list[ImageEntry]
) -> Manifest:
    counts = {c: sum(1 for e in entries if e.label == i) for i, c in enumerate(manifest.classes)}
    subset = manifest.model_copy(
        update={
            "images": entries,
            "counts": counts,
            "source": str(source.resolve()),
            "skipped": [],
            "duplicates": find_duplicates(entries),
        }
    )
    with atomic_directory(dest) as tmp:
        for entry in entries:
            target = tmp / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / entry.path, target)
        write_manifest(tmp, subset)
    return subset


def _first_share(fraction: float, n: int) -> int:
    """``floor(fraction * n)``, immune to float noise (0.29 * 100 is 28.999999999999996)."""
    return min(n, math.floor(round(fraction * n, 9)))


def _check_paths(source: Path, first: Path, second: Path) -> None:
    src, one, two = source.resolve(), first.resolve(), second.resolve()
    for name, out in (("first", one), ("second", two)):
        if out == src or out.is_relative_to(src) or src.is_relative_to(out):
            # Writing there would replace or nest inside the source while it is being read.
            raise InvalidParameterError(
                f"The {name} output {out} overlaps the source {src}.",
                "Write the two halves to folders beside the source, e.g. data/train, data/val.",
            )
    if one == two or one.is_relative_to(two) or two.is_relative_to(one):
        raise InvalidParameterError(
            f"The two outputs {one} and {two} overlap.", "Give them two separate folders."
        )


def split(
    source: Path, first: Path, second: Path, *, fraction: float = 0.9, seed: int = 1
) -> tuple[Manifest, Manifest]:
    """Split ``source`` into ``first`` (``fraction`` of each class) and ``second`` (the rest).

    Each output is written atomically. Returns the two manifests. Raises
    :class:`InvalidParameterError` for a fraction outside [0, 1] or outputs that overlap the
    source or each other, and :class:`InvalidImageDirectoryError` when ``source`` is not an
    ImageDirectory.
    """
    if isinstance(fraction, bool) or not 0.0 <= fraction <= 1.0:  # NaN fails the comparison too
        raise InvalidParameterError(
            f"fraction must be between 0 and 1, got {fraction}.", "Use e.g. 0.9 for a 90/10 split."
        )
    source, first, second = Path(source), Path(first), Path(second)
    manifest = read_manifest(source)
    _check_paths(source, first, second)
    rng = np.random.default_rng(seed)
    groups: dict[int | None, list[ImageEntry]] = {}
    for entry in manifest.images:
        groups.setdefault(entry.label, []).append(entry)
    chosen: list[ImageEntry] = []
    rest: list[ImageEntry] = []
    # Classes in id order and entries in path order: the draw depends on the seed and the
    # content only, never on the order the manifest happened to list them.
    for label in sorted(groups, key=lambda x: -1 if x is None else x):
        entries = sorted(groups[label], key=lambda e: e.path)
        order = rng.permutation(len(entries))
        cut = _first_share(fraction, len(entries))
        chosen += [entries[i] for i in sorted(order[:cut])]
        rest += [entries[i] for i in sorted(order[cut:])]
    return (
        _write_subset(source, first, manifest, chosen),
        _write_subset(source, second, manifest, rest),
    )


split_task = step(split, name="split")
