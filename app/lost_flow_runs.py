"""Flow runs whose process is gone with no worker to see it: ended by the server's automations.

A worker that sees its flow run's process die ends the run Crashed, and it is the one that
cancels the run when asked. When the worker died first (its machine lost, SIGKILL), nobody would:
the run stayed RUNNING, or Cancelling, for ever. Prefect's documented answer (docs.prefect.io,
"Detect and respond to zombie flows"): the flow-run process sends a heartbeat event every
HEARTBEAT_S, and an automation of the server ends Crashed a flow run that sent none for
ZOMBIE_AFTER_S. A second one ends Cancelled a run still Cancelling CANCEL_AFTER_S after it was
asked to (a live process, worker or none, cancels itself within seconds: app.flow_run_entry).
The imageops worker gives its flow runs the heartbeat setting (:func:`heartbeat_environment`);
the stacks that own a Prefect server create the automations (:func:`ensure_automations`).
Details: docs/training.md#failures-and-cancellation.
"""

from __future__ import annotations

from typing import Any

HEARTBEAT_S = 30  # Prefect's shortest heartbeat interval
ZOMBIE_AFTER_S = 90  # three heartbeats missed: the process is gone
CANCEL_AFTER_S = 60  # a cancellation nobody carried out: no process is left to carry it out
ZOMBIE_AUTOMATION = "imageops: crash flow runs without a heartbeat"
CANCEL_AUTOMATION = "imageops: cancel flow runs nobody cancels"
HEARTBEAT_VARIABLE = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"
FINAL_EVENTS = {
    "prefect.flow-run.Completed",
    "prefect.flow-run.Failed",
    "prefect.flow-run.Cancelled",
    "prefect.flow-run.Crashed",
}


def heartbeat_environment() -> dict[str, str]:
    """What a worker's environment needs for its flow runs to send heartbeats every
    HEARTBEAT_S (Prefect's default is every 180 s: a crash would be seen after 9 minutes)."""
    return {HEARTBEAT_VARIABLE: str(HEARTBEAT_S)}


def automations() -> list[Any]:
    """The two automations (see the module), as Prefect's ``AutomationCore``."""
    from datetime import timedelta

    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    def missing(after: str, expect: set[str], seconds: int) -> EventTrigger:
        return EventTrigger(
            after={after},
            expect=expect,
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=seconds),
        )

    made_by = "Created by imageops serve / imageops team server."
    return [
        AutomationCore(
            name=ZOMBIE_AUTOMATION,
            description=f"A flow run that sent no heartbeat for {ZOMBIE_AFTER_S} s (its process "
            f"died with no worker to see it) is marked Crashed. {made_by}",
            # A cancellation asked for ends this wait: the other automation finishes it.
            trigger=missing(
                "prefect.flow-run.heartbeat",
                {"prefect.flow-run.heartbeat", "prefect.flow-run.Cancelling", *FINAL_EVENTS},
                ZOMBIE_AFTER_S,
            ),
            actions=[
                ChangeFlowRunState(
                    state=StateType.CRASHED,
                    message=f"No heartbeat for {ZOMBIE_AFTER_S} s: the flow run's process "
                    "died, and no worker saw it end.",
                )
            ],
        ),
        AutomationCore(
            name=CANCEL_AUTOMATION,
            description=f"A flow run still Cancelling {CANCEL_AFTER_S} s after it was asked to "
            f"(no process is left to cancel it) is marked Cancelled. {made_by}",
            trigger=missing("prefect.flow-run.Cancelling", FINAL_EVENTS, CANCEL_AFTER_S),
            actions=[
                ChangeFlowRunState(
                    state=StateType.CANCELLED,
                    message=f"Cancelled: nothing answered the cancellation within "
                    f"{CANCEL_AFTER_S} s (the flow run's worker and process are gone).",
                )
            ],
        ),
    ]


def ensure_automations(client: Any) -> None:
    """Create the automations on the server of ``client`` (a sync Prefect client), or put the
    project's version back where someone changed one: one of each name, as shipped. Kept as they
    are when unchanged: a new one would forget the flow runs it was waiting on."""
    for wanted in automations():
        found = client.read_automations_by_name(wanted.name)
        if len(found) == 1 and _does(found[0].model_dump(mode="json")) == _does(
            wanted.model_dump(mode="json")
        ):
            continue
        for automation in found:
            client.delete_automation(automation.id)
        client.create_automation(wanted)


def _does(dumped: dict[str, Any]) -> dict[str, Any]:
    """What an automation does (the server gives its trigger an id of its own; its sets of event
    names come back in the order one process's hashing gave them)."""
    trigger = {
        k: sorted(v) if isinstance(v, list) and all(isinstance(x, str) for x in v) else v
        for k, v in (dumped.get("trigger") or {}).items()
        if k != "id"
    }
    return {"enabled": dumped.get("enabled"), "trigger": trigger, "actions": dumped.get("actions")}
