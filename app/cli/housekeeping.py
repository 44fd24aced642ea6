"""``imageops gc``: list what disk space can be given back, and with ``--yes`` give it back.

Each stage says what of its own may go and checks again under its owner's lock as it removes it
(:mod:`tasks.train.retention`, :mod:`tasks.registry.cache_retention`,
:mod:`tasks.registry.promotion_retention`, :mod:`tasks.data.cache_retention`); this command gathers
the lists and shows them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from app.cli.root import app, out
from tasks.shared.reclaim import Reclaimable, left_trash
from tasks.shared.settings import Settings, get_settings

DAY_S = 86400.0


def list_reclaimable(settings: Settings, older_than_days: float) -> list[Reclaimable]:
    """Everything ``imageops gc`` would remove now, in the order it removes it."""
    from tasks.data.cache_retention import unused_dvc_cache
    from tasks.registry.cache_retention import unaliased_cache_entries
    from tasks.registry.model_uri import CACHE_DIR
    from tasks.registry.promote import PROMOTIONS_DIR
    from tasks.registry.promotion_retention import partial_promotions
    from tasks.train.retention import finished_run_folders, old_outputs

    cache = settings.home_dir / CACHE_DIR
    folders = [settings.outputs_dir, settings.runs_dir, settings.home_dir / PROMOTIONS_DIR, cache]
    folders += sorted(p for p in cache.iterdir() if p.is_dir()) if cache.is_dir() else []
    return [
        *(item for folder in folders for item in left_trash(folder)),
        *old_outputs(settings, older_than_days * DAY_S),
        *finished_run_folders(settings),
        *unaliased_cache_entries(settings),
        *partial_promotions(settings),
        *unused_dvc_cache(settings),
    ]


def _size(count: float) -> str:
    if count < 1000:
        return f"{count:.0f} B"
    for unit in ("kB", "MB"):
        count /= 1000
        if count < 1000:
            return f"{count:.1f} {unit}"
    return f"{count / 1000:.1f} GB"


@app.command("gc")
def collect_garbage(
    yes: Annotated[
        bool,
        typer.Option(
            "--yes",
            help="Remove what is listed. Without it nothing is removed: the list is a dry run.",
        ),
    ] = False,
    older_than: Annotated[
        float,
        typer.Option(
            min=0,
            help="Days an outputs folder must have been left unchanged to be listed (a flow "
            "still exporting or scoring into a newer one keeps it).",
        ),
    ] = 7.0,
) -> None:
    """List the disk space training runs leave behind; remove it with --yes.

    Old outputs folders, run folders of FINISHED runs, registry-cache entries of versions without
    an alias, folders of promotions killed before their decision, DVC cache entries no .dvc file
    (work tree, git HEAD, local branches and tags) or DVC experiment refers to. Never what a
    registered version, an alias, a job being trained, a scoring or promotion running, or a
    committed .dvc file uses.
    """
    settings = get_settings()
    items = list_reclaimable(settings, older_than)
    if not items:
        out.print("nothing to reclaim")
        return
    table = Table("what", "path", "size", "why it can go", title_justify="left")
    table.columns[1].no_wrap = True  # whole paths, to copy; the reasons wrap instead
    for item in items:
        table.add_row(
            item.kind, escape(_shown(item.path, settings)), _size(item.size), escape(item.reason)
        )
    total = sum(item.size for item in items)
    table.title = f"reclaimable: {_size(total)} in {len(items)} places"
    out.print(table)
    if not yes:
        out.print("dry run: nothing removed; run `imageops gc --yes` to remove these")
        return
    freed, kept = 0, []
    for item in items:
        if item.remove():
            freed += item.size
        else:
            kept.append(item)
    for item in kept:
        out.print(escape(f"kept {item.path}: in use now"))
    out.print(f"removed {len(items) - len(kept)} of {len(items)}, {_size(freed)} freed")


def _shown(path: Path, settings: Settings) -> str:
    """``path`` from the project's root when it is inside (shorter: the table fits a terminal)."""
    root, full = settings.project_root.resolve(), path.resolve()
    return str(full.relative_to(root)) if full.is_relative_to(root) else str(path)
