"""What a person sees of a step in the Prefect UI: markdown reports with their pictures inline.

Prefect artifacts hold text, not files, so pictures travel as PNG data URIs inside the markdown.
Outside a Prefect run (tests, DVC stages, the step CLI) publishing is a no-op: the same pictures
are in MLflow either way.
"""

from __future__ import annotations

import base64
from pathlib import Path

from tasks.shared.step import in_prefect_run

TRAINING_REPORT = "training-report"  # the training run's curves, metrics and logs


def png_markdown(path: Path, alt: str) -> str:
    """An inline markdown image of the PNG at ``path`` (empty if it is missing)."""
    path = Path(path)
    if not path.is_file():
        return ""
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f"![{alt}](data:image/png;base64,{data})"


def for_people(value: object) -> object:
    """A float as people read it: 4 decimals, or 3 significant digits when smaller than 0.001
    (a learning rate of 1e-05, not 0.0000); anything else as it is."""
    if not isinstance(value, float):
        return value
    return f"{value:.3g}" if 0 < abs(value) < 0.001 else f"{value:.4f}"


def markdown_table(rows: list[dict[str, object]]) -> str:
    """A markdown table of ``rows`` (same keys in every row); floats as :func:`for_people`."""
    if not rows:
        return ""
    columns = list(rows[0])

    def cell(value: object) -> str:
        return str(for_people(value))

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

    shown = [{k: for_people(v) for k, v in row.items()} for row in rows]
    create_table_artifact(table=shown, key=key, description=description)
    return True


def republish(keys: tuple[str, ...]) -> int:
    """Create in this flow run the latest markdown artifact of each of ``keys`` that its sub-flows
    (or their tasks) made; returns how many.

    Prefect shows a run's own artifacts only: a deployment whose work happens in a sub-flow
    (training) would otherwise show nothing on the run a person started. The sub-flows are found
    through the API, not through the state a sub-flow call returns: that state can be the API's
    copy, which holds no result (see :func:`flows.train.train_and_report`).
    """
    if not in_prefect_run():
        return 0
    from prefect.artifacts import create_markdown_artifact
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )
    from prefect.client.schemas.sorting import ArtifactSort
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return 0  # in a task run: its flow run is where people look
    with get_client(sync_client=True) as client:
        parent = FlowRunFilterParentFlowRunId(any_=[context.flow_run.id])
        sub_flows = client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=parent))
        if not sub_flows:
            return 0
        query = ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[run.id for run in sub_flows]),
            key=ArtifactFilterKey(any_=list(keys)),
        )
        found = client.read_artifacts(artifact_filter=query, sort=ArtifactSort.CREATED_DESC)
    latest = {}
    for artifact in found:  # newest first: the first of each key is its latest
        if artifact.type == "markdown" and artifact.key not in latest:
            latest[artifact.key] = artifact
    for artifact in latest.values():
        create_markdown_artifact(
            markdown=str(artifact.data), key=artifact.key, description=artifact.description
        )
    return len(latest)
