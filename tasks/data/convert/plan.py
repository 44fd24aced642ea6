"""A conversion plan: every file to check and where it goes, made by an input source before any
image is opened (see :mod:`tasks.data.convert.sources`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from tasks.data.imagedir import SkippedFile, is_image_file, manifest_path_problem
from tasks.data.imageformat import SkipReason, printable_name
from tasks.data.labelfiles import Listed, Listing


@dataclass(frozen=True, slots=True)
class PlannedFile:
    """One file to check, and where it goes when it passes."""

    source: str  # the file to read
    rel: str  # its path relative to the source root (or the label file's folder)
    dest: str  # its path in the ImageDirectory
    label: str | None  # its class name
    origin: str | None = None  # recorded as the entry's source_path (label files)


@dataclass
class ConversionPlan:
    """Everything to convert, before any file is opened."""

    labeled: bool
    items: list[PlannedFile]
    classes: list[str]  # the classes the source names: each one left without images is reported
    skipped: list[SkippedFile]
    label_file: bool = False  # classes come from labels, not folders (the wording of reports)

    def __post_init__(self) -> None:
        # A destination the ImageDirectory's readers would refuse (a class folder `C:` reads as
        # a Windows drive) is skipped here, with its reason, not written for split to refuse.
        kept = []
        for item in self.items:
            problem = manifest_path_problem(item.dest)
            if problem is None:
                kept.append(item)
            else:
                reason = SkipReason.BAD_FILE_NAME.because(
                    f"stored as {item.dest!r} it reads as {problem}: rename it"
                )
                self.skipped.append(SkippedFile(path=printable_name(item.rel), reason=reason))
        self.items = kept
        # In the ImageDirectory's order: checked in it, the entries go to the manifest as they
        # come (a folder's plan is in this order already).
        self.items.sort(key=lambda item: item.dest)

    def class_sizes(self) -> dict[str, int]:
        """Image files per class, counted by name: no more than convert can keep of each."""
        sizes = dict.fromkeys(self.classes, 0)
        for item in self.items:
            if item.label is not None and is_image_file(PurePosixPath(item.rel)):
                sizes[item.label] = sizes.get(item.label, 0) + 1
        return sizes


def plan_listing(listing: Listing) -> ConversionPlan:
    """The plan for what a label file lists: each image to ``<class>/<its file name>``."""
    names = unique_names(listing.entries, listing.labeled)
    items = [
        PlannedFile(str(entry.path), entry.rel, names[entry.rel], entry.label, entry.rel)
        for entry in listing.entries
    ]
    return ConversionPlan(listing.labeled, items, listing.classes, listing.skipped, label_file=True)


def unique_names(entries: Sequence[Listed], labeled: bool) -> dict[str, str]:
    """Where each listed file goes: ``<class>/<file name>`` (``<file name>`` when unlabeled).

    Files from different folders may share a name. The first one (in path order) keeps it; the
    others get ``<stem>_1<suffix>``, ``_2``..., skipping names that are taken. Names are compared
    without case, so the directory also copies to macOS and Windows intact. The result depends
    only on the set of files, never on the order the label file lists them.
    """
    folders: dict[str, list[Listed]] = {}
    for entry in sorted(entries, key=lambda e: e.rel):
        folders.setdefault((entry.label or "") if labeled else "", []).append(entry)
    names: dict[str, str] = {}
    for folder, members in folders.items():
        prefix = f"{folder}/" if folder else ""
        taken: set[str] = set()
        later: list[Listed] = []
        for entry in members:  # first pass: every name its first holder keeps
            name = PurePosixPath(entry.rel).name
            if name.casefold() in taken:
                later.append(entry)
            else:
                taken.add(name.casefold())
                names[entry.rel] = prefix + name
        for entry in later:
            name = PurePosixPath(PurePosixPath(entry.rel).name)
            n = 1
            while f"{name.stem}_{n}{name.suffix}".casefold() in taken:
                n += 1
            free = f"{name.stem}_{n}{name.suffix}"
            taken.add(free.casefold())
            names[entry.rel] = prefix + free
    return names
