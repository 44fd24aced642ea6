"""A flow run whose process dies unseen ends Crashed: heartbeats, and the server's automation.

A worker that sees its flow run's process die ends the run Crashed. When the worker died first
(its machine lost, SIGKILL), nobody would: the run stayed RUNNING for ever. Prefect's documented
answer (docs.prefect.io, "Detect and respond to zombie flows"): the flow-run process sends a
heartbeat event every HEARTBEAT_S, and an automation of the server ends Crashed a flow run that
sent none for ZOMBIE_AFTER_S. The imageops worker passes the heartbeat setting to its flow runs
(:func:`heartbeat_environment`); the stacks that own a Prefect server create the automation
(:func:`ensure_zombie_automation`). Details: docs/training.md#failures-and-cancellation.
"""

from __future__ import annotations

from typing import Any

HEARTBEAT_S = 30  # Prefect's shortest heartbeat interval
ZOMBIE_AFTER_S = 90  # three heartbeats missed: the process is gone
AUTOMATION_NAME = "imageops: crash flow runs without a heartbeat"
HEARTBEAT_VARIABLE = "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"


def heartbeat_environment() -> dict[str, str]:
    """What a worker's environment needs for its flow runs to send heartbeats every
    HEARTBEAT_S (Prefect's default is every 180 s: a crash would be seen after 9 minutes)."""
    return {HEARTBEAT_VARIABLE: str(HEARTBEAT_S)}


def zombie_automation() -> Any:
    """The automation: a flow run with no heartbeat, nor end, for ZOMBIE_AFTER_S -> Crashed."""
    from datetime import timedelta

    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return AutomationCore(
        name=AUTOMATION_NAME,
        description=(
            f"A flow run that sent no heartbeat for {ZOMBIE_AFTER_S} s (its process died with no "
            "worker to see it) is marked Crashed. Created by imageops serve / imageops team server."
        ),
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={
                "prefect.flow-run.heartbeat",
                "prefect.flow-run.Completed",
                "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed",
            },
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=ZOMBIE_AFTER_S),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=(
                    f"No heartbeat for {ZOMBIE_AFTER_S} s: the flow run's process died, and no "
                    "worker saw it end."
                ),
            )
        ],
    )


def ensure_zombie_automation(client: Any) -> None:
    """Create the automation on the server of ``client`` (a sync Prefect client), or put the
    project's version back where someone changed it: one of that name, as shipped. Kept as it is
    when unchanged: a new one would forget the flow runs whose heartbeats it was waiting for."""
    wanted = zombie_automation()
    found = client.read_automations_by_name(AUTOMATION_NAME)
    shipped = wanted.model_dump(mode="json")
    if len(found) == 1 and _core(found[0]) == _core_of(shipped):
        return
    for automation in found:
        client.delete_automation(automation.id)
    client.create_automation(wanted)


def _core(automation: Any) -> dict[str, Any]:
    return _core_of(automation.model_dump(mode="json"))


def _core_of(dumped: dict[str, Any]) -> dict[str, Any]:
    """What the automation does (the server gives its trigger an id of its own)."""
    trigger = {k: v for k, v in (dumped.get("trigger") or {}).items() if k != "id"}
    return {"enabled": dumped.get("enabled"), "trigger": trigger, "actions": dumped.get("actions")}
