"""What Convert tells the user: the summary it logs, and why nothing could be converted."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from tasks.data.imagedir import MANIFEST, SkippedFile
from tasks.data.manifest_stream import StreamedManifest

log = logging.getLogger("tasks.data.convert")

NOTHING_USABLE_HINT = (
    "Pass a folder (or archive) of .jpg/.png/... images, in one sub-folder per class for a "
    "labeled set; check that the files open in an image viewer."
)
LABEL_FILE_HINT = (
    "Check that the paths in the label file are relative to its folder, that the files are "
    "there, and that they open in an image viewer."
)


def nothing_usable(source: Path, skipped: Sequence[SkippedFile], label_file: bool) -> str:
    if not skipped:
        return f"No usable image in {source}: it {'lists' if label_file else 'holds'} no files."
    by_code: dict[str, int] = {}
    for item in skipped:
        code = item.reason.split(":", 1)[0]
        by_code[code] = by_code.get(code, 0) + 1
    summary = ", ".join(f"{n} {code}" for code, n in sorted(by_code.items()))
    first = next((s for s in skipped if not s.path.endswith("/")), skipped[0])
    return (
        f"No usable image in {source}: everything was skipped ({summary}); "
        f"for example {first.path} ({first.reason})."
    )


def log_summary(dest: Path, manifest: StreamedManifest) -> None:
    log.info(
        "Converted %d image(s) into %s (%s, %d skipped).",
        manifest.image_count,
        dest,
        f"{len(manifest.classes)} classes" if manifest.labeled else "unlabeled",
        len(manifest.skipped),
    )
    if manifest.skipped:
        log.warning("%d file(s) skipped; see `skipped` in %s.", len(manifest.skipped), MANIFEST)
    if manifest.duplicates:
        log.warning(
            "%d group(s) of identical images; see `duplicates` in %s.",
            len(manifest.duplicates),
            MANIFEST,
        )
