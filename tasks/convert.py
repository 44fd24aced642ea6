"""Convert to Image Directory: raw images (a folder or an archive) become an ImageDirectory.

Class sub-folders are labels; a flat folder is unlabeled (for scoring). Every file is opened,
verified and decoded; the ones that fail are skipped and listed in the manifest with the reason,
and the good ones are copied byte for byte, with their sha256 and size recorded.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from PIL import Image

from models.atomic import atomic_directory
from tasks.errors import NoUsableImagesError
from tasks.imagedir import (
    PIL_FORMATS,
    ImageEntry,
    Manifest,
    SkippedFile,
    is_image_file,
    load_rgb,
    write_manifest,
)
from tasks.step import step


def _inspect(path: Path) -> tuple[str, int, int]:
    """sha256, width, height of a valid image; raises if it does not decode."""
    data = path.read_bytes()
    if not data:
        raise ValueError("empty file")
    with Image.open(path, formats=PIL_FORMATS) as img:
        img.verify()  # structure and checksums; the full decode below catches truncation
    width, height = load_rgb(path).size
    return hashlib.sha256(data).hexdigest(), width, height


def _layout(source: Path) -> tuple[bool, list[Path]]:
    """Labeled when every image sits one level down, in a class folder."""
    files = sorted(p for p in source.rglob("*") if p.is_file() and p.name != "manifest.json")
    in_class_folders = [p for p in files if p.parent != source and p.parent.parent == source]
    labeled = bool(files) and len(in_class_folders) == len(files)
    return labeled, files


def convert(source: Path, dest: Path) -> Manifest:
    """Convert the image folder ``source`` into the ImageDirectory ``dest`` (written atomically)."""
    source, dest = Path(source), Path(dest)
    if not source.is_dir():
        raise NoUsableImagesError(
            f"{source} is not a folder.", "Pass a folder of images (class sub-folders = labels)."
        )
    labeled, files = _layout(source)
    classes = sorted({p.parent.name for p in files}) if labeled else []
    images: list[ImageEntry] = []
    skipped: list[SkippedFile] = []
    with atomic_directory(dest) as tmp:
        for path in files:
            rel = path.relative_to(source).as_posix()
            if not is_image_file(path):
                skipped.append(SkippedFile(path=rel, reason="not an image extension"))
                continue
            try:
                sha, width, height = _inspect(path)
            except Exception as exc:
                skipped.append(SkippedFile(path=rel, reason=f"unreadable: {exc}"))
                continue
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            label = classes.index(path.parent.name) if labeled else None
            images.append(ImageEntry(path=rel, label=label, sha256=sha, width=width, height=height))
        if not images:
            raise NoUsableImagesError(
                f"No usable image in {source} ({len(skipped)} file(s) skipped).",
                "Check the extensions (.png, .jpg, ...) and that the files open in an image viewer.",
            )
        counts = {c: sum(1 for e in images if e.label == i) for i, c in enumerate(classes)}
        manifest = Manifest(
            labeled=labeled,
            classes=classes,
            counts=counts,
            images=images,
            source=str(source.resolve()),
            skipped=skipped,
        )
        write_manifest(tmp, manifest)
    return manifest


convert_task = step(convert, name="convert")
