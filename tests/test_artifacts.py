"""A sub-flow's report is shown on the run a person started, and the sub-flow's result is taken
from the call, never from its state: a state can come back from Prefect's API without it."""

from __future__ import annotations

import uuid

import httpx
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from prefect.context import get_run_context
from prefect.exceptions import MissingResult
from prefect.settings import PREFECT_API_URL
from prefect.states import Completed, Running, State, to_state_create

from tasks.shared.artifacts import publish_markdown, republish


@flow(name="reporting-sub-flow")
def reporting_sub_flow(markdown: str) -> int:
    publish_markdown("training-report", markdown, "the sub-flow's report")
    return len(markdown)


@flow(name="calls-two-sub-flows")
def calls_two_sub_flows() -> tuple[list[int], str, int]:
    values = [reporting_sub_flow("# attempt 1"), reporting_sub_flow("# attempt 2, curves")]
    return values, str(get_run_context().flow_run.id), republish(("training-report",))


@pytest.mark.slow
def test_the_newest_sub_flow_report_is_shown_on_the_calling_run(prefect_api: None) -> None:
    values, run_id, shown = calls_two_sub_flows()
    assert values == [11, 19]
    assert shown == 1
    with get_client(sync_client=True) as client:
        here = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
        (report,) = client.read_artifacts(artifact_filter=here)
    assert (report.key, report.data) == ("training-report", "# attempt 2, curves")
    assert republish(("training-report",)) == 0  # outside a flow run: nowhere to show it


@pytest.mark.slow
def test_a_final_state_sent_twice_comes_back_without_its_result(prefect_api: None) -> None:
    """What Prefect's client does when a busy server's answer is lost: it sends the same request
    again (same transition id). The server, having committed the first, rejects the second and
    answers with its own copy of the state, which holds no result: ``state.result()`` on it
    raises. This is why flows.train.train_and_report takes the call's return value."""

    @flow(name="finishes")
    def finishes() -> None:
        pass

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(finishes)
        client.set_flow_run_state(run.id, Running())
    # The final state as the client sends it: the result stays in memory, so no data goes.
    completed = to_state_create(Completed(data=42))
    completed.state_details.transition_id = uuid.uuid4()
    body = {"state": completed.model_dump(mode="json", serialize_as_any=True)}
    url = f"{PREFECT_API_URL.value()}/flow_runs/{run.id}/set_state"
    answers = [httpx.post(url, json=body, timeout=30).json() for _ in range(2)]
    assert [a["status"] for a in answers] == ["ACCEPT", "REJECT"]
    returned = State.model_validate(answers[1]["state"])
    assert returned.is_completed() and returned.data is None
    with pytest.raises(MissingResult):
        returned.result()
