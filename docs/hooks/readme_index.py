"""MkDocs hook: the site's home page is the README, so the landing page exists once.

The README links into the docs as ``docs/page.md`` (so they work on GitHub); on the site the
home page sits inside ``docs/``, so that prefix comes off.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

README = Path(__file__).resolve().parents[2] / "README.md"


def on_files(files: Files, config: Any, **_: Any) -> Files:
    """Add ``index.md``, the README with its links into ``docs/`` made relative to the site."""
    text = re.sub(r"\]\(docs/", "](", README.read_text())
    files.append(File.generated(config, "index.md", content=text))
    return files
