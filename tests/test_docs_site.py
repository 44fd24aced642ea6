"""The README is the landing page and the rest is the docs site (mkdocs.yml, `make docs`).

The strict build itself (every link, anchor and page) is CI's `make docs`; these checks are the
cheap part a newcomer meets first: a short README whose links all land.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300


def test_the_readme_is_a_landing_page_whose_links_land() -> None:
    """At most 300 lines, and every relative link a page of the docs site (docs/*.md)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    relative = [link for link in links if "://" not in link]
    assert relative, "the README links into the docs"
    assert [link for link in relative if not link.startswith("docs/")] == []
    assert [link for link in relative if not (ROOT / link).is_file()] == []


def test_every_docs_page_is_in_the_sites_navigation() -> None:
    """A page left out of mkdocs.yml's nav is a page no reader of the site finds."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)

    def pages(nav: object) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        items = nav.values() if isinstance(nav, dict) else nav
        return [page for item in items for page in pages(item)]

    listed = set(pages(config["nav"]))
    on_disk = {path.name for path in (ROOT / "docs").glob("*.md")}
    assert on_disk - listed == set()
    assert listed - on_disk == {"index.md"}  # the README, added by docs/hooks/readme_index.py
