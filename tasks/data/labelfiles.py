"""Label files for Convert: a CSV manifest or a COCO classification JSON lists images and labels.

A CSV manifest has the columns ``path`` and ``label``; a COCO file ``images``, ``annotations`` (one
category per image) and ``categories``. Paths are relative to the label file's folder; an entry
leading outside it, missing, or with a bad or conflicting label is refused and reported. A file that
cannot be read as a whole raises :class:`InvalidLabelFileError` naming the line or field.
Details: docs/convert.md#label-files.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, PlainValidator, ValidationError

from models.bounded_parse import MAX_DEPTH, json_depth
from tasks.data.imagedir import SkippedFile, SkipReason, is_utf8, printable_name
from tasks.shared.errors import InvalidLabelFileError

_DRIVE = re.compile(r"^[A-Za-z]:")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# A label file is read whole: refuse one larger than this before reading it. 1M COCO entries
# with annotations take about 120 MB.
MAX_LABEL_FILE_BYTES = 1024**3
_CSV_HINT = (
    "The first line must be the header `path,label`; each further line a path relative to the "
    "CSV's folder and a label (empty for none). Quote a field that holds a comma."
)
_COCO_HINT = (
    "A COCO classification file is an object with `images` [{id, file_name}], `annotations` "
    "[{image_id, category_id}] and `categories` [{id, name}]."
)


@dataclass(frozen=True)
class Listed:
    """One image the label file names, found inside the base folder."""

    path: Path  # the file itself (symlinks resolved)
    rel: str  # its POSIX path relative to the base, normalised
    label: str | None


@dataclass
class Listing:
    """What a label file lists: the images to check, and the entries refused already."""

    base: Path
    labeled: bool
    entries: list[Listed] = field(default_factory=list)  # one per file, sorted by rel
    classes: list[str] = field(default_factory=list)  # every class named, sorted
    skipped: list[SkippedFile] = field(default_factory=list)


@dataclass(frozen=True)
class Row:
    """One entry of a label file, as written: checked and resolved by :func:`read_label_file`."""

    raw: str  # the path as written
    label: str | None
    where: str  # "line 7", "images[3]": where to look in the file
    problem: str = ""  # a skip reason found while reading (COCO: several or unknown categories)


# A label file format: its text (path, for messages) to its rows, and the classes it declares
# (None: the classes are the labels the rows name).
RowReader = Callable[[Path, str], tuple[list[Row], list[str] | None]]


class _Refused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def read_label_file(path: Path, read_rows: RowReader, *, exclude: Path | None = None) -> Listing:
    """Read the label file ``path`` with ``read_rows`` (its format) and find the images it lists.

    Entries that resolve inside ``exclude`` (the destination being written) are refused too.
    Raises :class:`InvalidLabelFileError` when the file cannot be read as a whole.
    """
    path = Path(path)
    rows, declared = read_rows(path, _read_text(path))
    return _resolve(path.parent, rows, declared, exclude)


def _read_text(path: Path) -> str:
    try:
        size = path.stat().st_size
        if size > MAX_LABEL_FILE_BYTES:
            raise InvalidLabelFileError(
                f"{path} is {size:,} bytes; imageops reads label files of up to "
                f"{MAX_LABEL_FILE_BYTES:,} bytes (they are read whole).",
                "Convert the images as a folder with one sub-folder per class, or split the "
                "label file into parts and `imageops convert` each.",
            )
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidLabelFileError(
            f"Cannot read {path}: {exc.strerror or exc}.",
            "Check that the file exists and is readable.",
        ) from exc
    try:
        return data.decode("utf-8-sig")  # Excel's "CSV UTF-8" starts with a byte-order mark
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InvalidLabelFileError(
            f"{path}, line {line}: not UTF-8 text ({exc.reason} at byte {exc.start}).",
            "Save the file as UTF-8 (in Excel: 'CSV UTF-8').",
        ) from exc


# --- CSV ----------------------------------------------------------------------------------------


def csv_rows(path: Path, text: str) -> tuple[list[Row], None]:
    """The rows of a CSV manifest (header ``path,label``)."""
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    header: list[str] | None = None
    columns: tuple[int, int] = (0, 0)
    rows: list[Row] = []
    try:
        for record in reader:
            if not any(cell.strip() for cell in record):
                continue  # blank line
            line = reader.line_num
            if header is None:
                header = [cell.strip().lower() for cell in record]
                columns = _csv_columns(path, header, line)
                continue
            if len(record) != len(header):
                raise InvalidLabelFileError(
                    f"{path}, line {line}: {len(record)} field(s) where the header has "
                    f"{len(header)}.",
                    _CSV_HINT,
                )
            raw, label = record[columns[0]].strip(), record[columns[1]].strip()
            if not raw:
                raise InvalidLabelFileError(f"{path}, line {line}: the path is empty.", _CSV_HINT)
            rows.append(Row(raw, label or None, f"line {line}"))
    except csv.Error as exc:
        raise InvalidLabelFileError(
            f"{path}, line {reader.line_num}: {exc}.",
            "Check the quotes on that line: a quoted field ends with a quote before the comma.",
        ) from exc
    if header is None:
        raise InvalidLabelFileError(f"{path} is empty: it has not even a header.", _CSV_HINT)
    return rows, None


def _csv_columns(path: Path, header: list[str], line: int) -> tuple[int, int]:
    found = []
    for name in ("path", "label"):
        if header.count(name) != 1:
            problem = "names no column" if name not in header else "names more than one column"
            raise InvalidLabelFileError(
                f"{path}, line {line}: the header {','.join(header)!r} {problem} {name!r}.",
                _CSV_HINT,
            )
        found.append(header.index(name))
    return found[0], found[1]


# --- COCO ---------------------------------------------------------------------------------------


def coco_rows(path: Path, text: str) -> tuple[list[Row], list[str]]:
    """The rows of a COCO classification JSON, and its categories' names."""
    depth = json_depth(text)
    if depth > MAX_DEPTH:
        raise InvalidLabelFileError(
            f"{path}: arrays and objects nested {depth:,} deep; a COCO file needs 3 levels and "
            f"imageops reads up to {MAX_DEPTH}.",
            _COCO_HINT,
        )
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidLabelFileError(
            f"{path}, line {exc.lineno}, column {exc.colno}: not valid JSON ({exc.msg}).",
            f"Fix the JSON there (`python -m json.tool {path.name}` shows where it breaks).",
        ) from exc
    if not isinstance(doc, dict):
        raise InvalidLabelFileError(
            f"{path}: the top level is {_json_type(doc)}, not an object.", _COCO_HINT
        )
    try:
        coco = _CocoFile.model_validate(doc)
    except ValidationError as exc:
        raise InvalidLabelFileError(f"{path}: {_coco_problem(doc, exc)}", _COCO_HINT) from exc
    categories, images = coco.categories, coco.images

    names: dict[Hashable, str] = {}
    first_with_name: dict[str, int] = {}
    for i, category in enumerate(categories):
        where = f"categories[{i}]"
        if category.id in names:
            raise InvalidLabelFileError(
                f"{path}: {where}.id {category.id!r} is used by another category too.",
                "Give every category its own id.",
            )
        if category.name in first_with_name:
            raise InvalidLabelFileError(
                f"{path}: {where}.name {category.name!r} is the name of categories"
                f"[{first_with_name[category.name]}] too.",
                "Give every category its own name (each becomes one class folder).",
            )
        names[category.id] = category.name
        first_with_name[category.name] = i

    image_ids: dict[Hashable, int] = {}
    for i, image in enumerate(images):
        if image.id in image_ids:
            raise InvalidLabelFileError(
                f"{path}: images[{i}].id {image.id!r} is the id of images[{image_ids[image.id]}] "
                "too.",
                "Give every image its own id.",
            )
        image_ids[image.id] = i

    # Per image, its categories in the order annotated, with the first annotation naming each.
    annotated: dict[int, dict[Hashable, int]] = {}
    for i, annotation in enumerate(coco.annotations):
        if annotation.image_id not in image_ids:
            raise InvalidLabelFileError(
                f"{path}: annotations[{i}].image_id {annotation.image_id!r} is not the id of any "
                "image.",
                "Remove the annotation or add its image to `images`.",
            )
        annotated.setdefault(image_ids[annotation.image_id], {}).setdefault(
            annotation.category_id, i
        )

    rows: list[Row] = []
    for i, image in enumerate(images):
        raw = image.file_name
        cats = annotated.get(i, {})
        unknown = [(cid, n) for cid, n in cats.items() if cid not in names]
        problem, label = "", None
        if unknown:
            cid, n = unknown[0]
            problem = SkipReason.UNKNOWN_CATEGORY.because(
                f"images[{i}]: annotations[{n}] names category {cid!r}, which is not in categories"
            )
        elif len(cats) > 1:
            listed = ", ".join(f"{names[cid]} (annotations[{n}])" for cid, n in cats.items())
            problem = SkipReason.MULTIPLE_LABELS.because(
                f"images[{i}] is annotated as {listed}; classification takes one label per image"
            )
        elif cats:
            label = names[next(iter(cats))]
        rows.append(Row(raw, label, f"images[{i}]", problem))
    return rows, list(names.values())


# Plain validators, not pydantic's str: a JSON "\udce9" is a str it refuses, while here it is an
# entry refused later (BadFileName), not a bad file.
def _an_id(value: Any) -> int | str:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("an id is a whole number or a string")
    return value


def _a_text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("it must be a non-empty string")
    return value.strip()


_Id = Annotated[int | str, PlainValidator(_an_id)]
_Text = Annotated[str, PlainValidator(_a_text)]


class _CocoImage(BaseModel):
    id: _Id
    file_name: _Text


class _CocoAnnotation(BaseModel):
    image_id: _Id
    category_id: _Id


class _CocoCategory(BaseModel):
    id: _Id
    name: _Text


class _CocoFile(BaseModel):
    """The part of a COCO file classification reads; other keys (bbox, licenses...) are kept
    out. Test sets list images only: no annotations (and maybe no categories) is unlabeled."""

    images: list[_CocoImage]
    annotations: list[_CocoAnnotation] = []
    categories: list[_CocoCategory] = []


# Which problem is told when there are several: a section's type first, then the entries of
# categories, images and annotations in that order (the names an image's label refers to first).
_SECTIONS = ("images", "annotations", "categories")
_ENTRIES = ("categories", "images", "annotations")
_ENTRY_FIELDS = {
    "images": tuple(_CocoImage.model_fields),
    "annotations": tuple(_CocoAnnotation.model_fields),
    "categories": tuple(_CocoCategory.model_fields),
}


def _coco_problem(doc: dict[str, Any], exc: ValidationError) -> str:
    """The first problem pydantic found, told with the field's path and the value found."""

    def order(error: Any) -> tuple[bool, int, int, int]:
        loc = error["loc"]
        if len(loc) == 1:
            return False, _SECTIONS.index(loc[0]), 0, 0
        fields = _ENTRY_FIELDS[loc[0]]
        return True, _ENTRIES.index(loc[0]), loc[1], fields.index(loc[2]) if len(loc) > 2 else -1

    error = min(exc.errors(), key=order)
    section, *rest = error["loc"][:3]
    if not rest:
        if error["type"] == "missing":
            return f"`{section}` is missing."
        return f"`{section}` is {_json_type(doc[section])}, not a list."
    where = f"{section}[{rest[0]}]"
    entry = doc[section][rest[0]]
    if len(rest) == 1:
        return f"{where} is {_json_type(entry)}, not an object."
    key = rest[1]
    if error["type"] == "missing":
        return f"{where} has no `{key}`."
    value = entry[key]  # refused by _an_id or _a_text, which say what it should be
    got = "an empty string" if isinstance(value, str) else _json_type(value)
    return f"{where}.{key} is {got}; {error['ctx']['error']}."


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "true/false"}
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"the number {value!r}"
    return names.get(type(value), type(value).__name__)


# --- from rows to files -------------------------------------------------------------------------


def _resolve(
    base: Path, rows: list[Row], declared: list[str] | None, exclude: Path | None
) -> Listing:
    """Check each row's path and label; keep one row per file; report the rest."""
    base_real = os.path.realpath(base)
    exclude_real = os.path.realpath(exclude) if exclude is not None else None
    # A row with a problem was annotated (with categories we cannot use): the list is labeled.
    labeled = any(row.label or row.problem for row in rows)
    listing = Listing(base=Path(base_real), labeled=labeled)

    def skip(row: Row, reason: str) -> None:
        listing.skipped.append(SkippedFile(path=printable_name(row.raw), reason=reason))

    by_file: dict[str, list[tuple[Row, Path]]] = {}
    for row in rows:
        try:
            if row.problem:
                raise _Refused(row.problem)
            if labeled and not row.label:
                raise _Refused(
                    SkipReason.MISSING_LABEL.because(
                        f"{row.where} has no label, while others have one"
                    )
                )
            if row.label and (bad := _bad_class_name(row.label)):
                raise _Refused(SkipReason.BAD_LABEL.because(f"{row.where}: {bad}"))
            real, rel = _inside(base_real, row.raw, row.where, exclude_real)
        except _Refused as refused:
            skip(row, refused.reason)
            continue
        by_file.setdefault(rel, []).append((row, real))

    for rel in sorted(by_file):
        group = by_file[rel]
        first, real = group[0]
        if len({row.label for row, _ in group}) > 1:
            listed = ", ".join(f"{row.where} ({row.label})" for row, _ in group)
            for row, _ in group:
                skip(row, SkipReason.MULTIPLE_LABELS.because(f"listed as {listed}"))
            continue
        for row, _ in group[1:]:
            skip(
                row,
                SkipReason.DUPLICATE_ENTRY.because(f"{row.where} lists the file of {first.where}"),
            )
        listing.entries.append(Listed(real, rel, first.label))

    if labeled:
        named = declared if declared is not None else [row.label or "" for row in rows]
        listing.classes = sorted({n for n in named if n and not _bad_class_name(n)})
    return listing


def _inside(base: str, raw: str, where: str, exclude: str | None) -> tuple[Path, str]:
    """The file ``raw`` names under ``base`` (realpath) and its normalised relative path."""
    name = raw.replace("\\", "/")  # a CSV written on Windows
    if "\x00" in name:
        raise _Refused(SkipReason.UNSAFE_PATH.because(f"{where}: NUL byte in the path"))
    if not is_utf8(name):  # JSON's "\udce9": no manifest can hold the name
        raise _Refused(SkipReason.BAD_FILE_NAME.because(f"{where}: the path is not UTF-8 text"))
    if name.startswith("/") or _DRIVE.match(name):
        raise _Refused(
            SkipReason.UNSAFE_PATH.because(
                f"{where}: absolute path; paths are relative to the label file's folder"
            )
        )
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise _Refused(SkipReason.UNSAFE_PATH.because(f"{where}: '..' in the path"))
    if not parts:
        raise _Refused(SkipReason.MISSING_FILE.because(f"{where}: the path names no file"))
    real = os.path.realpath(os.path.join(base, *parts))
    if os.path.commonpath([base, real]) != base:
        raise _Refused(SkipReason.UNSAFE_PATH.because(f"{where}: a symlink leads outside {base}"))
    if exclude is not None and os.path.commonpath([exclude, real]) == exclude:
        raise _Refused(
            SkipReason.UNSAFE_PATH.because(f"{where}: inside the destination being written")
        )
    if not os.path.exists(real):
        raise _Refused(SkipReason.MISSING_FILE.because(f"{where}: no such file in {base}"))
    if not os.path.isfile(real):
        # A folder, or a FIFO that would block the reader forever.
        raise _Refused(SkipReason.NOT_AN_IMAGE.because(f"{where}: not a regular file"))
    return Path(real), "/".join(parts)


def _bad_class_name(name: str) -> str:
    """Why ``name`` cannot be a class folder's name, or "" when it can."""
    if "/" in name or "\\" in name:
        return f"the label {name!r} holds a slash; labels become folder names"
    if name in (".", "..") or name.startswith("."):
        return f"the label {name!r} starts with '.'; labels become (visible) folder names"
    if _CONTROL.search(name):
        return f"the label {name!r} holds a control character"
    if not is_utf8(name):
        return f"the label {name!r} is not UTF-8 text"
    if len(name.encode("utf-8")) > 255:
        return "the label is longer than a folder name may be (255 bytes)"
    return ""
