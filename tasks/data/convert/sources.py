"""Input sources of Convert: what ``imageops convert SOURCE`` can read, one class each.

A source says whether it reads a path (:meth:`InputSource.detect`) and plans its conversion
(:meth:`InputSource.plan`: every file to check and where it goes). :data:`INPUT_SOURCES` holds
them in the order they are asked; the first that detects a path converts it, and a path none
detects is an error that lists them. Adding a format is one class and one
:func:`register_source` line; a new label file format only turns its text into
:class:`tasks.data.labelfiles.Row` (see :class:`LabelFileSource`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import ClassVar

from models.atomic import scratch_folder
from tasks.data.archive import ARCHIVE_SUFFIXES, archive_kind, extract_archive
from tasks.data.convert.folders import (
    archive_class_sizes,
    layout_classes,
    paths_in,
    plan_folder,
    unwrap,
)
from tasks.data.convert.limits import ConvertLimits
from tasks.data.convert.plan import ConversionPlan, plan_listing
from tasks.data.labelfiles import Row, coco_rows, csv_rows, read_label_file
from tasks.shared.errors import NoUsableImagesError


class InputSource:
    """One kind of input. ``name`` is recorded in the cache key (changing it converts again);
    ``described`` completes "Pass ..." in the hints that list what imageops reads."""

    name: ClassVar[str]
    described: ClassVar[str]
    # Its bytes are part of the cache key (a file read whole), and, when self_contained, all of
    # it: the key is known before planning, so an unchanged archive is not even extracted.
    whole_file: ClassVar[bool] = True
    self_contained: ClassVar[bool] = False

    def detect(self, path: Path) -> bool:
        """Whether this source reads ``path`` (an existing file or folder)."""
        raise NotImplementedError

    def plan(
        self, path: Path, dest: Path, limits: ConvertLimits
    ) -> AbstractContextManager[ConversionPlan]:
        """The plan to convert ``path`` into ``dest``; the files it names stay readable while the
        context is open (an archive's extraction is removed when it closes)."""
        raise NotImplementedError

    def classes(self, path: Path) -> list[str]:
        """The classes ``path`` names, without decoding any image ([] when unlabeled)."""
        raise NotImplementedError

    def class_sizes(self, path: Path) -> dict[str, int] | None:
        """Image files per class of ``path``, counted by name without opening any: no more than
        convert keeps, so a request can be checked against it before convert runs. None: this
        source cannot count without converting."""
        return None

    def parameters(self, limits: ConvertLimits) -> dict[str, int]:
        """The limits that can change what this source converts to (part of the cache key)."""
        return limits.images()


class FolderSource(InputSource):
    name = "folder"
    described = "a folder of images (class sub-folders = labels)"
    whole_file = False

    def detect(self, path: Path) -> bool:
        return path.is_dir()

    @contextmanager
    def plan(self, path: Path, dest: Path, limits: ConvertLimits) -> Iterator[ConversionPlan]:
        yield plan_folder(path, [])

    def classes(self, path: Path) -> list[str]:
        return layout_classes(None, path)

    def class_sizes(self, path: Path) -> dict[str, int]:
        return plan_folder(path, []).class_sizes()


class ArchiveSource(InputSource):
    name = "archive"
    described = f"an archive of one ({', '.join(ARCHIVE_SUFFIXES)})"
    self_contained = True

    def detect(self, path: Path) -> bool:
        return archive_kind(path) is not None

    @contextmanager
    def plan(self, path: Path, dest: Path, limits: ConvertLimits) -> Iterator[ConversionPlan]:
        # Beside dest, locked while in use: a killed run's extraction is removed by the next.
        with scratch_folder(dest, "extract") as extracted:
            caps = limits.archive()
            refused = extract_archive(
                path,
                extracted,
                max_members=caps["max_archive_members"],
                max_bytes=caps["max_archive_bytes"],
                max_member_bytes=caps["max_archive_member_bytes"],
                max_ratio=caps["max_archive_ratio"],
            )
            root, junk = unwrap(extracted)
            yield plan_folder(root, refused + junk)

    def classes(self, path: Path) -> list[str]:
        return layout_classes(paths_in(path), path)

    def class_sizes(self, path: Path) -> dict[str, int]:
        return archive_class_sizes(paths_in(path), path)

    def parameters(self, limits: ConvertLimits) -> dict[str, int]:
        # A smaller cap could refuse an archive a larger one let through.
        return limits.images() | limits.archive()


class LabelFileSource(InputSource):
    """A file naming images (relative to its folder) and their labels; known by its suffix.

    A format only implements :meth:`rows`; paths, labels and duplicates are checked as for
    every label file (:func:`tasks.data.labelfiles.read_label_file`).
    """

    suffixes: ClassVar[tuple[str, ...]]

    def detect(self, path: Path) -> bool:
        return path.name.lower().endswith(self.suffixes)

    def rows(self, path: Path, text: str) -> tuple[list[Row], list[str] | None]:
        """The entries of ``text``, and the classes it declares (None: those its rows name).
        Raises InvalidLabelFileError naming ``path`` and the line or field at fault."""
        raise NotImplementedError

    @contextmanager
    def plan(self, path: Path, dest: Path, limits: ConvertLimits) -> Iterator[ConversionPlan]:
        yield plan_listing(read_label_file(path, self.rows, exclude=dest))

    def classes(self, path: Path) -> list[str]:
        listing = read_label_file(path, self.rows)
        return listing.classes if listing.labeled else []

    def class_sizes(self, path: Path) -> dict[str, int]:
        listing = read_label_file(path, self.rows)
        return plan_listing(listing).class_sizes() if listing.labeled else {}


class CsvSource(LabelFileSource):
    name = "csv"
    described = "a CSV label file (.csv, header path,label)"
    suffixes = (".csv",)

    def rows(self, path: Path, text: str) -> tuple[list[Row], list[str] | None]:
        return csv_rows(path, text)


class CocoSource(LabelFileSource):
    name = "coco"
    described = "a COCO classification label file (.json)"
    suffixes = (".json",)

    def rows(self, path: Path, text: str) -> tuple[list[Row], list[str] | None]:
        return coco_rows(path, text)


INPUT_SOURCES: list[InputSource] = []


def register_source(source: InputSource) -> InputSource:
    """Add ``source`` to what Convert reads, asked after the ones registered before it."""
    if any(s.name == source.name for s in INPUT_SOURCES):
        raise ValueError(f"An input source named {source.name!r} is registered already.")
    INPUT_SOURCES.append(source)
    return source


for _source in (FolderSource(), ArchiveSource(), CsvSource(), CocoSource()):
    register_source(_source)


def supported() -> str:
    """What imageops reads, for hints: "a folder ..., an archive ... or a CSV ..."."""
    described = [s.described for s in INPUT_SOURCES]
    return (
        ", ".join(described[:-1]) + f" or {described[-1]}" if len(described) > 1 else described[0]
    )


def label_file_sources() -> str:
    """The label file formats, for hints."""
    return " or ".join(s.described for s in INPUT_SOURCES if isinstance(s, LabelFileSource))


def find_source(path: Path) -> InputSource:
    """The source that reads ``path``; NoUsableImagesError for a missing path or one none reads."""
    if not path.exists():
        raise NoUsableImagesError(f"{path} does not exist.", f"Pass {supported()}.")
    for source in INPUT_SOURCES:
        if source.detect(path):
            return source
    raise NoUsableImagesError(
        f"{path} is neither a folder nor an archive or label file imageops reads "
        f"({', '.join(s.name for s in INPUT_SOURCES)}).",
        f"Pass {supported()}.",
    )
