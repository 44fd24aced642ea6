"""What a person sees of a step in the Prefect UI: markdown reports with their pictures inline.

Prefect artifacts hold text, not files, so pictures travel as PNG data URIs inside the markdown.
Outside a Prefect run (tests, DVC stages, the step CLI) publishing is a no-op: the same pictures
are in MLflow either way.
"""

from __future__ import annotations

import base64
from pathlib import Path

from tasks.shared.step import in_prefect_run


def png_markdown(path: Path, alt: str) -> str:
    """An inline markdown image of the PNG at ``path`` (empty if it is missing)."""
    path = Path(path)
    if not path.is_file():
        return ""
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f"![{alt}](data:image/png;base64,{data})"


def markdown_table(rows: list[dict[str, object]]) -> str:
    """A markdown table of ``rows`` (same keys in every row); floats with 4 decimals."""
    if not rows:
        return ""
    columns = list(rows[0])

    def cell(value: object) -> str:
        return f"{value:.4f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def publish_markdown(key: str, markdown: str, description: str) -> bool:
    """Create a markdown artifact when inside a Prefect run; returns whether one was made."""
    if not in_prefect_run():
        return False
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(markdown=markdown, key=key, description=description)
    return True


def publish_table(key: str, rows: list[dict[str, object]], description: str) -> bool:
    """Create a table artifact (sortable in the UI) when inside a Prefect run."""
    if not in_prefect_run():
        return False
    from prefect.artifacts import create_table_artifact

    create_table_artifact(table=rows, key=key, description=description)
    return True
