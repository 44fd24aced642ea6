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
