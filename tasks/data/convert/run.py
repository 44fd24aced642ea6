"""Convert's steps in order: check the parameters, find the source, consult the cache, plan,
check every file and write the ImageDirectory with its manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from models.atomic import atomic_directory, check_destination, remove_leftovers
from tasks.data.convert import cache, checking, report
from tasks.data.convert.limits import ConvertLimits, check_apart, check_workers
from tasks.data.convert.plan import ConversionPlan
from tasks.data.convert.sources import find_source, label_file_sources
from tasks.data.datasets import holding_folders
from tasks.data.imagecheck import CheckJob
from tasks.data.imagedir import (
    FORMAT_VERSION,
    MANIFEST,
    ImageEntry,
    ManifestHead,
    SkippedFile,
    SkipReason,
    printable_name,
    recorded_source,
)
from tasks.data.manifest_stream import ManifestWriter, StreamedManifest
from tasks.shared.errors import InvalidDatasetError, NotLabeledDatasetError, NoUsableImagesError
from tasks.shared.step import step, tasks_on_first_use

# Part of every fingerprint: bump it when a change here or in tasks.data.imagecheck can change the
# result for the same input, so directories converted before are converted again.
# 2: the aspect-ratio limit; files refused by extension or size are no longer read.
_CONVERTER_VERSION = 2


def convert(
    source: Path,
    dest: Path,
    limits: ConvertLimits | None = None,
    *,
    workers: int | None = None,
) -> StreamedManifest:
    """Convert the image folder, archive or label file ``source`` into the ImageDirectory ``dest``.

    ``dest`` is written atomically, and left as it is when it already holds this very conversion.
    ``limits`` caps each image and archive; ``workers`` checks images in that many processes
    (default: every core, once the input gains from them). Returns the manifest. Raises
    InvalidParameterError, UnsafeArchiveError, InvalidLabelFileError, or NoUsableImagesError (a
    source missing, unreadable, of no kind read, or with no usable image).
    Details: docs/convert.md#convert.
    """
    source, dest = Path(source), Path(dest)
    limits = ConvertLimits() if limits is None else limits
    check_workers(workers)
    check_apart(source, dest)
    check_destination(dest, replaces=MANIFEST)
    with holding_folders(dest):  # version and other writers of dest wait
        # A killed run's leftovers beside dest: removed even when the cache check below writes
        # nothing.
        remove_leftovers(dest)
        remove_leftovers(dest, "extract")
        reader = find_source(source)
        head = {
            "converter": _CONVERTER_VERSION,
            "format_version": FORMAT_VERSION,
            "kind": reader.name,
            "parameters": reader.parameters(limits),
            # A file read whole anyway (an archive, a label file): its own bytes are part of the
            # key.
            "input_sha256": cache.sha256_file(source)[1] if reader.whole_file else None,
        }
        previous = cache.previous(dest, source)
        # Self-contained: the key is known before planning, so an unchanged source is not read.
        if reader.self_contained:
            key = cache.fingerprint(head)
            if previous is not None and previous.fingerprint == key:
                return cache.unchanged(dest, previous)
            with reader.plan(source, dest, limits) as plan:
                return _convert_plan(plan, dest, source, limits, workers, key)
        with reader.plan(source, dest, limits) as plan:
            if previous is not None and previous.fingerprint == cache.fingerprint(
                head, plan, cache.hash_all(plan.items, limits.max_pixels)
            ):
                return cache.unchanged(dest, previous)
            return _convert_plan(plan, dest, source, limits, workers, head)


def source_classes(source: Path) -> list[str]:
    """The classes a source's layout names, read without converting it (no image is decoded).

    For refusing, before a pipeline starts, a source no classifier can learn from: folders and
    archives by their class sub-folders (the first folder of each path, after the wrapper
    folder a zip often has), label files by their labels. Raises NoUsableImagesError for a
    missing or unreadable source, NotLabeledDatasetError when the layout has no classes, and
    InvalidDatasetError for fewer than two.
    """
    source = Path(source)
    classes = find_source(source).classes(source)
    if not classes:
        raise NotLabeledDatasetError(
            f"{source} has no class sub-folders: its images are not labeled, and training "
            "needs labels.",
            "Put each class's images in a sub-folder named after the class (raw/cat/1.jpg, "
            f"raw/dog/2.jpg), or pass {label_file_sources()}. To score unlabeled "
            "images with a trained model, use `imageops score`.",
        )
    if len(classes) < 2:
        raise InvalidDatasetError(
            f"{source} has only the class {classes[0]!r}; a classifier needs two or more.",
            "Add a sub-folder of images for each other class.",
        )
    return classes


def _convert_plan(
    plan: ConversionPlan,
    dest: Path,
    source: Path,
    limits: ConvertLimits,
    workers: int | None,
    key: str | dict[str, Any],
) -> StreamedManifest:
    """Check every planned file, copy the good ones into a new ``dest``, write the manifest.

    ``key`` is the final fingerprint, or the head of one to finish with the hashes the workers
    computed of the files they read (no file is read twice).
    """
    skipped = list(plan.skipped)
    made = cache.Fingerprint(key, plan) if isinstance(key, dict) else None
    # Ids of every class the plan names; one left without an image is dropped at the end.
    named = sorted(set(plan.classes) | {i.label for i in plan.items if i.label is not None})
    class_id = {name: i for i, name in enumerate(named)}
    images = limits.images()
    with atomic_directory(dest, replaces=MANIFEST) as tmp:

        def jobs(start: int, stop: int) -> list[CheckJob]:
            return [
                CheckJob(item.source, item.rel, str(tmp / item.dest), scratch=str(tmp), **images)
                for item in plan.items[start:stop]
            ]

        count = len(plan.items)
        stripes = checking.processes(count, jobs, workers)
        with ManifestWriter(tmp, dest, parts=stripes) as written:
            # Each entry is written as its file is checked, never kept: a stripe of the plan
            # (which is in the manifest's order) to each part of the list.
            for stripe, start, results in checking.check_in_order(count, jobs, stripes):
                for index, result in enumerate(results, start):
                    item = plan.items[index]
                    if made is not None:
                        made.add(index, item, result.size, result.sha256)
                    if result.reason:
                        skipped.append(SkippedFile(path=result.rel, reason=result.reason))
                        continue
                    entry = ImageEntry(
                        path=item.dest,
                        label=None if item.label is None else class_id[item.label],
                        sha256=result.sha256,
                        width=result.width,
                        height=result.height,
                        size=result.size,
                        source_path=item.origin,
                    )
                    written.add(entry, stripe)
            kept = written.classes_used(len(named))
            classes = [name for name, used in zip(named, kept, strict=True) if used]
            what = "class" if plan.label_file else "class folder"
            for name in plan.classes:
                if name not in classes:
                    skipped.append(
                        SkippedFile(
                            path=printable_name(name) + "/",
                            reason=SkipReason.EMPTY_CLASS.because(
                                f"no valid image in this {what}; the class is left out"
                            ),
                        )
                    )
            if not written.count:
                raise NoUsableImagesError(
                    report.nothing_usable(source, skipped, plan.label_file),
                    report.LABEL_FILE_HINT if plan.label_file else report.NOTHING_USABLE_HINT,
                )
            if len(classes) < len(named):  # ids shift down past each class left out
                written.relabel({named.index(name): i for i, name in enumerate(classes)})
            head = ManifestHead(
                labeled=plan.labeled,
                classes=classes,
                source=recorded_source(source),
                skipped=sorted(skipped, key=lambda s: s.path),
                fingerprint=key if made is None else made.hexdigest(),
            )
            manifest = written.finish(head)
    report.log_summary(dest, manifest)
    return manifest


__getattr__ = tasks_on_first_use(
    globals(),
    convert_task=lambda: step(convert, name="convert"),
)
