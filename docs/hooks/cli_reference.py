"""MkDocs hook: the CLI reference page (cli-reference.md) written from the commands themselves.

Every command's and sub-command's ``--help``, rendered by the CLI's own layout at a fixed width
with no colours, at each build: the page cannot fall behind the code. The committed page is the
stub a reader on GitHub sees; the site's page is the stub followed by the generated text.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from typing import Any

PAGE = "cli-reference.md"
WIDTH = 80  # a terminal no one widened, and what the page's code blocks show without scrolling


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every visible command and sub-command under ``command``, with the words that name it."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        if not getattr(sub, "hidden", False):
            yield from _commands(sub, (*path, name))


def _help(root: Any, path: tuple[str, ...]) -> str:
    """``imageops PATH --help`` as a terminal of WIDTH columns shows it, colours removed."""
    from rich.text import Text

    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        root.main([*path, "--help"], prog_name="imageops", standalone_mode=False)
    lines = Text.from_ansi(shown.getvalue()).plain.rstrip().splitlines()
    return "\n".join(line.rstrip() for line in lines)


def cli_reference() -> str:
    """The reference's Markdown: one section per command, its help in a code block."""
    import typer

    from app.cli import app

    saved = {name: os.environ.get(name) for name in ("COLUMNS", "NO_COLOR", "TERM")}
    os.environ.update(COLUMNS=str(WIDTH), NO_COLOR="1", TERM="dumb")
    try:
        root = typer.main.get_command(app)
        sections = [
            f"## {' '.join(('imageops', *path))}\n\n```text\n{_help(root, path)}\n```\n"
            for path, _ in _commands(root)
        ]
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return "\n".join(sections)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """The reference page gets the generated sections after its committed introduction."""
    if page.file.src_uri != PAGE:
        return markdown
    return f"{markdown.rstrip()}\n\n{cli_reference()}"
