"""Every step is a Prefect task with retries: crashes are retried, bad input fails at once."""

from __future__ import annotations

import pytest
from prefect import flow

from tasks.shared.errors import InvalidParameterError, TrainingFailedError
from tasks.shared.step import step


@pytest.mark.slow
def test_crashes_are_retried_and_user_errors_are_not(prefect_api: None) -> None:
    calls = {"bad_input": 0, "flaky": 0, "crashed_worker": 0}

    def bad_input() -> None:
        calls["bad_input"] += 1
        raise InvalidParameterError("epochs = 0, expected an integer > 0.")

    def flaky() -> str:
        calls["flaky"] += 1
        if calls["flaky"] < 3:
            raise OSError("disk briefly full")
        return "done"

    def crashed_worker() -> None:
        calls["crashed_worker"] += 1
        raise TrainingFailedError("rank 1 was killed.")

    quick = {"retry_delay_seconds": 0, "retry_jitter_factor": None}
    bad_task = step(bad_input, name="bad-input", **quick)
    flaky_task = step(flaky, name="flaky", **quick)
    crash_task = step(crashed_worker, name="crashed-worker", retries=1, **quick)

    @flow(name="retry-policy")
    def retry_policy() -> tuple[bool, str, bool]:
        bad = bad_task(return_state=True)
        crash = crash_task(return_state=True)
        return bad.is_failed(), flaky_task(), crash.is_failed()

    assert retry_policy() == (True, "done", True)
    assert calls == {"bad_input": 1, "flaky": 3, "crashed_worker": 2}


@pytest.mark.slow
def test_a_run_name_a_person_typed_is_kept_and_a_made_up_one_replaced(prefect_api: None) -> None:
    from prefect.client.orchestration import get_client
    from prefect.context import get_run_context

    from tasks.shared.step import name_flow_run

    @flow(name="named-run")
    def named() -> str:
        name_flow_run("train-resnet18")
        name_flow_run("train-resnet18-data-1234abcd")  # our own name, made more precise
        return str(get_run_context().flow_run.id)

    def final_name(run_id: str) -> str:
        with get_client(sync_client=True) as client:
            return client.read_flow_run(run_id).name

    assert final_name(named()) == "train-resnet18-data-1234abcd"  # Prefect's random name went
    typed = named.with_options(flow_run_name="my-retrain-after-relabel")
    assert final_name(typed()) == "my-retrain-after-relabel"


@pytest.mark.slow
def test_a_run_is_named_from_its_parameters_before_its_first_log_line(prefect_api: None) -> None:
    """The score flow's way (issue 47, finding 13): Prefect's "Beginning flow run ..." line
    carried the random name; named from the parameters, it carries the run's own, which the flow
    may still make more precise. A typed name stays, here too."""
    from prefect.client.orchestration import get_client
    from prefect.context import get_run_context
    from prefect_runs import info_logs_sent, log_messages_of

    from tasks.shared.step import name_flow_run, named_from_parameters

    @flow(name="named-early", flow_run_name=named_from_parameters(lambda p: f"score-{p['images']}"))
    def early(images: str) -> str:
        name_flow_run(f"score-v3-{images}")
        return str(get_run_context().flow_run.id)

    def final_name(run_id: str) -> str:
        with get_client(sync_client=True) as client:
            return client.read_flow_run(run_id).name

    with info_logs_sent():
        run_id = early("val")
    assert final_name(run_id) == "score-v3-val"  # ours, so made more precise, not kept as typed

    def begun(messages: list[str]) -> bool:
        return any(m.startswith("Beginning flow run") for m in messages)

    messages = log_messages_of(run_id, complete=begun, timeout_s=60)
    assert "Beginning flow run 'score-val' for flow 'named-early'" in messages, messages
    # A run created with a person's name (the form's Run Name), then run: the name stays.
    from prefect.flow_engine import run_flow

    with get_client(sync_client=True) as client:
        made = client.create_flow_run(early, name="nightly-by-hand", parameters={"images": "val"})
    run_flow(early, flow_run=made, parameters={"images": "val"})
    assert final_name(str(made.id)) == "nightly-by-hand"
    # A run that leaves a parameter to its default (as a deployment's may) is named from it too.

    @flow(
        name="named-by-default", flow_run_name=named_from_parameters(lambda p: f"s-{p['images']}")
    )
    def defaulted(images: str = "digits") -> None:
        pass

    with get_client(sync_client=True) as client:
        made = client.create_flow_run(defaulted, parameters={})
    run_flow(defaulted, flow_run=made, parameters={})
    assert final_name(str(made.id)) == "s-digits"
