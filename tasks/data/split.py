"""Split Image Directory: one ImageDirectory becomes two (or three), stratified and seeded.

The fraction goes to the first output (rounded down per class, so every class keeps its share);
the same seed and input always give the same split. An optional third (test) output takes
``third_fraction`` of each class from what the first left, and the second keeps the rest; with no
third output the split is exactly Azure's two-way one. Every output keeps the full class list,
so their class ids agree. An unlabeled directory is split the same way, as one group.

The outputs hold the source's images linked, not copied (:mod:`tasks.data.file_links`): a hard
link is read-only, and each source image is checked against the manifest's sha256 first, so an
image edited in place (which a link would carry into every output) is refused, not spread.
"""

from __future__ import annotations

import math
import os
from array import array
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from models.atomic import atomic_directory, check_destination
from tasks.data.datasets import holding_folders
from tasks.data.file_links import Placer
from tasks.data.imagedir import MANIFEST, ImageEntry, recorded_source
from tasks.data.manifest_stream import ManifestWriter, StreamedManifest, iter_images, read_head
from tasks.shared.errors import InvalidImageDirectoryError, InvalidParameterError
from tasks.shared.file_hash import file_sha256
from tasks.shared.step import step, step_logger, tasks_on_first_use


def _check_unchanged(source: Path, entry: ImageEntry) -> None:
    """Refuse an image whose bytes are not the ones convert recorded.

    Outputs share the source's files: an image edited in place (in this folder, or through a
    hard link in an earlier split's) would otherwise reach every output with a manifest that
    says otherwise.
    """
    _, digest = file_sha256(os.path.join(source, entry.path))
    if digest != entry.sha256:
        raise InvalidImageDirectoryError(
            f"{source / entry.path} is not the image {MANIFEST} lists (its sha256 is {digest}, "
            f"not {entry.sha256}): it was changed after {source} was written.",
            "Edit images in the raw source and run `imageops convert` again (docs/images.md"
            "#links says why an edit in place is refused).",
        )


def first_share(fraction: float, n: int) -> int:
    """``floor(fraction * n)``, immune to float noise (0.29 * 100 is 28.999999999999996): how
    many of a class's ``n`` images the first output gets."""
    return min(n, math.floor(round(fraction * n, 9)))


def _overlap(a: Path, b: Path) -> bool:
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def _check_paths(source: Path, outputs: dict[str, Path]) -> None:
    src = source.resolve()
    resolved = {name: out.resolve() for name, out in outputs.items()}
    for name, out in resolved.items():
        if _overlap(out, src):
            # Writing there would replace or nest inside the source while it is being read.
            raise InvalidParameterError(
                f"The {name} output {out} overlaps the source {src}.",
                "Write the outputs to folders beside the source, e.g. data/train, data/val.",
            )
    names = list(resolved)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if _overlap(resolved[a], resolved[b]):
                raise InvalidParameterError(
                    f"The {a} and {b} outputs {resolved[a]} and {resolved[b]} overlap.",
                    "Give every output its own folder.",
                )


def _check_fraction(name: str, value: float) -> None:
    if isinstance(value, bool) or not 0.0 <= value <= 1.0:  # NaN fails the comparison too
        raise InvalidParameterError(
            f"{name} must be between 0 and 1, got {value}.", "Use e.g. 0.9 for a 90/10 split."
        )


def split(
    source: Path,
    first: Path,
    second: Path,
    *,
    fraction: float = 0.9,
    seed: int = 1,
    third: Path | None = None,
    third_fraction: float = 0.0,
) -> tuple[StreamedManifest, ...]:
    """Split ``source`` into ``first`` (``fraction`` of each class) and ``second`` (the rest).

    With ``third``, that output takes ``third_fraction`` of each class (rounded down) out of what
    the first did not take. Each output is written atomically. Returns the manifests in output
    order (two or three). The source's manifest is streamed twice (to draw, then to write), so
    memory holds a path and a label per image, not the manifests. Raises
    :class:`InvalidParameterError` for fractions outside [0, 1] or summing above 1, or outputs
    that overlap the source or each other, and :class:`InvalidImageDirectoryError` when
    ``source`` is not an ImageDirectory.
    """
    _check_fraction("fraction", fraction)
    _check_fraction("third_fraction", third_fraction)
    if third is None and third_fraction:
        raise InvalidParameterError(
            f"third_fraction = {third_fraction} needs a third output folder.",
            "Name a third output folder, or leave third_fraction at 0.",
        )
    if fraction + third_fraction > 1.0 + 1e-9:
        raise InvalidParameterError(
            f"fraction + third_fraction = {fraction + third_fraction:g} is more than 1.",
            "Lower one of them; the second output gets what is left.",
        )
    source, first, second = Path(source), Path(first), Path(second)
    outputs = {"first": first, "second": second} | ({"third": Path(third)} if third else {})
    _check_paths(source, outputs)
    # The source too: a convert replacing it between the two passes would mix two of its states.
    with holding_folders(source, *outputs.values()):
        return _split(source, outputs, fraction, third_fraction, seed)


def _split(
    source: Path, outputs: dict[str, Path], fraction: float, third_fraction: float, seed: int
) -> tuple[StreamedManifest, ...]:
    """:func:`split`, its parameters checked and its folders' locks held."""
    head = read_head(source)
    for out in outputs.values():  # all of them before writing any: no half split
        check_destination(out, replaces=MANIFEST)
    # First pass: the paths and labels only (a string and 8 bytes an image), every image
    # checked before any output is written: no half split.
    paths: list[str] = []
    labels = array("q")
    for entry in iter_images(source):
        _check_unchanged(source, entry)
        paths.append(entry.path)
        labels.append(-1 if entry.label is None else entry.label)
    where = _draw(paths, np.frombuffer(labels, dtype=np.int64), fraction, third_fraction, seed)
    del paths
    # Second pass: each image linked into its output and its line written there. An output
    # keeps the source's order; its counts and duplicates are the writer's.
    subset = head.model_copy(
        update={
            "source": recorded_source(source),
            "skipped": [],
            # The fingerprint describes a conversion; a split is not one (and is cheap to redo).
            "fingerprint": None,
        }
    )
    placer = Placer()
    with ExitStack() as stack:
        writers = [
            stack.enter_context(
                ManifestWriter(stack.enter_context(atomic_directory(out, replaces=MANIFEST)), out)
            )
            for out in outputs.values()
        ]
        made: set[str] = set()
        for index, entry in enumerate(iter_images(source)):
            writer = writers[where[index]]
            # Strings, not Paths: pathlib costs more than the link per image.
            target = os.path.join(writer.root, entry.path)
            if (folder := os.path.dirname(target)) not in made:
                os.makedirs(folder, exist_ok=True)
                made.add(folder)
            placer.place(os.path.join(source, entry.path), target)
            writer.add(entry)
        written = tuple(writer.finish(subset) for writer in writers)
    step_logger(__name__).info("split %s: images %s", source, placer.summary())
    return written


def _draw(
    paths: list[str], labels: np.ndarray, fraction: float, third_fraction: float, seed: int
) -> np.ndarray:
    """Which output each image goes to (0 first, 1 second, 2 third), by its place in the list.

    Classes in id order and images in path order: the draw depends on the seed and the content
    only, never on the order the manifest happened to list them.
    """
    rng = np.random.default_rng(seed)
    where = np.ones(len(paths), dtype=np.int8)
    for label in np.unique(labels):  # -1 (unlabeled) first, then the class ids in order
        members = np.flatnonzero(labels == label)
        members = members[
            np.argsort(np.array([paths[i] for i in members], dtype=object), kind="stable")
        ]
        order = rng.permutation(len(members))
        cut = first_share(fraction, len(members))
        cut_third = cut + min(len(members) - cut, first_share(third_fraction, len(members)))
        where[members[order[:cut]]] = 0
        where[members[order[cut:cut_third]]] = 2
    return where


__getattr__ = tasks_on_first_use(
    globals(),
    split_task=lambda: step(split, name="split"),
)
