"""The Prefect event that says "a model version got an alias", and the trigger that listens for it.

One contract for both ways a promotion reaches Prefect: the webhook receiver (``app/webhook.py``,
with an ``mlflow server``) and the promote step itself (embedded mode) emit it, and a trigger from
:func:`alias_trigger` matches it, so scoring starts the same way in both. Alias and version are
labels of the registered model's resource. Details: docs/promotion.md#the-promotion-event.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from prefect.events import DeploymentEventTrigger, Event, emit_event, get_events_client
from prefect.settings import PREFECT_API_URL

from tasks.shared.errors import InvalidParameterError
from tasks.shared.step import in_prefect_run, step_logger

ALIAS_CREATED_EVENT = "mlflow.model_version_alias.created"
RESOURCE_PREFIX = "mlflow.registered_model."
NAME_LABEL = "mlflow.registered_model.name"
ALIAS_LABEL = "mlflow.alias"
VERSION_LABEL = "mlflow.model_version"
CHAMPION = "champion"
EVENTS_RECONNECTS = 3  # the receiver answers MLflow within its 30 s request timeout


def model_resource_id(name: str) -> str:
    """The Prefect resource id of a registered model: what triggers match on."""
    return f"{RESOURCE_PREFIX}{name}"


def _fields(name: str, alias: str, version: int | str, source: str) -> dict[str, Any]:
    version = str(version)
    if not name or not alias or not version.isdigit():
        raise InvalidParameterError(
            f"An alias event needs a model name, an alias and a version number; got "
            f"name={name!r}, alias={alias!r}, version={version!r}.",
        )
    return {
        "event": ALIAS_CREATED_EVENT,
        "resource": {
            "prefect.resource.id": model_resource_id(name),
            "prefect.resource.name": name,
            NAME_LABEL: name,
            ALIAS_LABEL: alias,
            VERSION_LABEL: version,
        },
        "payload": {
            "name": name,
            "alias": alias,
            "version": version,
            "model_uri": f"models:/{name}@{alias}",
            "version_uri": f"models:/{name}/{version}",
            "source": source,
        },
    }


def alias_event(
    name: str,
    alias: str,
    version: int | str,
    *,
    source: str = "imageops",
    event_id: UUID | None = None,
) -> Event:
    """The event for ``alias`` now pointing at ``version`` of registered model ``name``.

    ``source`` says who saw the promotion (``mlflow-webhook`` or ``imageops``); ``event_id``
    lets a re-delivered webhook carry the same id (Prefect then sees one event, not two).
    """
    fields = _fields(name, alias, version, source)
    return Event(**fields) if event_id is None else Event(**fields, id=event_id)


def emit_alias_event(
    name: str, alias: str, version: int | str, *, source: str = "imageops"
) -> Event | None:
    """Emit the alias event to the Prefect API this process uses (the promote step's way).

    Queued on Prefect's events worker and sent in the background (flushed at exit), like every
    event Prefect itself emits. Outside a Prefect run and with no PREFECT_API_URL there is no
    server whose triggers could react, so nothing is sent (Prefect would start an ephemeral API
    for it, seconds of work for an event nobody reads). Returns the event, or None when none was
    sent.
    """
    fields = _fields(name, alias, version, source)
    if not PREFECT_API_URL.value() and not in_prefect_run():
        step_logger(__name__).info(
            "No Prefect server (PREFECT_API_URL) to tell that %s@%s is version %s; set it for "
            "the scoring deployment's trigger to run.",
            name,
            alias,
            version,
        )
        return None
    return emit_event(fields["event"], fields["resource"], payload=fields["payload"])


async def send_event(event: Event) -> None:
    """Send one event now and return once Prefect took it; raise if it could not.

    The webhook receiver uses this instead of the background queue so that it answers MLflow
    with an error (and MLflow retries) when Prefect is down, rather than dropping a promotion.
    """
    async with get_events_client(reconnection_attempts=EVENTS_RECONNECTS) as client:
        await client.emit(event)


# Prefect renders a trigger's parameters as Jinja templates of the triggering event.
VERSION_URI_TEMPLATE = "{{ event.payload.version_uri }}"


def alias_trigger(
    name: str,
    alias: str = CHAMPION,
    *,
    parameters: dict[str, Any] | None = None,
    enabled: bool = True,
) -> DeploymentEventTrigger:
    """A deployment trigger: run when ``alias`` of ``name`` is set, with ``model`` = the version
    the event names (``models:/<name>/<version>``, the event's ``version_uri``).

    Not ``models:/<name>@<alias>``: that is resolved when the run starts, and a second alias move
    in between would have both runs score the later version. ``parameters`` are added to (and
    may override) ``{"model": ...}``; the deployment's own defaults fill the rest.
    """
    return DeploymentEventTrigger(
        name=f"{name}@{alias} promoted",
        description=f"Runs when a version of {name} becomes @{alias} in the MLflow registry.",
        enabled=enabled,
        expect={ALIAS_CREATED_EVENT},
        match={"prefect.resource.id": model_resource_id(name), ALIAS_LABEL: alias},
        parameters={"model": VERSION_URI_TEMPLATE, **(parameters or {})},
    )
