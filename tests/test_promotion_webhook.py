"""Promotion starts scoring: MLflow's signed webhook -> receiver -> Prefect event -> scoring run.

The fast tests drive the receiver in-process (FastAPI's TestClient) against the session's real
Prefect API and read the events back from it. The slow test runs the whole chain as a person
would: a real ``mlflow server``, a real ``prefect server start``, the receiver and the served
scoring deployment, each in its own process, and sets the alias through MLflow's REST API.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest
import yaml
from fastapi.testclient import TestClient
from mlflow.webhooks.constants import (
    WEBHOOK_DELIVERY_ID_HEADER,
    WEBHOOK_SIGNATURE_HEADER,
    WEBHOOK_TIMESTAMP_HEADER,
)
from mlflow.webhooks.delivery import _generate_hmac_signature
from mlflow.webhooks.types import ModelVersionAliasCreatedPayload
from prefect_runs import prefect_api_at
from server_processes import Processes, base_env, free_port, healthy

from app import webhook
from app.webhook import MAX_BODY_BYTES, PATH, create_app
from tasks.data.imagedir import read_manifest
from tasks.registry.promotion_events import (
    ALIAS_CREATED_EVENT,
    emit_alias_event,
    model_resource_id,
)
from tasks.shared import servers
from tasks.shared.database_templates import seed
from tasks.shared.errors import ImageOpsError
from tasks.shared.settings import Settings

pytest_plugins = ["model_fixtures"]

ROOT = Path(__file__).resolve().parents[1]
SECRET = "test-secret-" + "x" * 20
NAME = "imageops-classifier"


def _signed(body: dict[str, Any] | str, secret: str = SECRET, age_s: int = 0) -> tuple[bytes, dict]:
    """A delivery as MLflow sends it: its JSON (``body``, or as it is when a str), headers and
    signature (MLflow's own function)."""
    payload = body if isinstance(body, str) else json.dumps(body)
    delivery_id, timestamp = str(uuid.uuid4()), str(int(time.time()) - age_s)
    return payload.encode(), {
        "Content-Type": "application/json",
        WEBHOOK_DELIVERY_ID_HEADER: delivery_id,
        WEBHOOK_TIMESTAMP_HEADER: timestamp,
        WEBHOOK_SIGNATURE_HEADER: _generate_hmac_signature(secret, delivery_id, timestamp, payload),
    }


def _alias_body(name: str, alias: str = "champion", version: str = "3") -> dict[str, Any]:
    return {
        "entity": "model_version_alias",
        "action": "created",
        "timestamp": "2026-01-01T00:00:00+00:00",
        "data": {"name": name, "alias": alias, "version": version},
    }


def _events(resource_id: str, want: int, timeout_s: float = 30.0) -> list[dict]:
    """The alias events about ``resource_id`` the Prefect API has, waiting for ``want`` of them."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    events: list[dict] = []
    with get_client(sync_client=True) as client:

        def enough() -> bool:
            query = EventFilter(
                event=EventNameFilter(name=[ALIAS_CREATED_EVENT]),
                resource=EventResourceFilter(id=[resource_id]),
            )  # made anew each time: its time window ends when it is made
            page = client.read_events(filter=query, limit=50)
            events[:] = [event.model_dump(mode="json") for event in page.events]
            return len(events) >= want

        servers.wait_until(enough, timeout_s, interval_s=0.5)
    return events


def test_unsigned_wrongly_signed_and_stale_deliveries_are_refused() -> None:
    client = TestClient(create_app(SECRET))
    body, headers = _signed(_alias_body("refused-model"))

    missing = client.post(PATH, content=body, headers={"Content-Type": "application/json"})
    assert missing.status_code == 401
    assert "missing X-MLflow-Signature" in missing.json()["detail"]

    unsigned = {k: v for k, v in headers.items() if k != WEBHOOK_SIGNATURE_HEADER}
    assert client.post(PATH, content=body, headers=unsigned).status_code == 401

    _, other = _signed(_alias_body("refused-model"), secret="another-secret")
    wrong = client.post(PATH, content=body, headers={**other})
    assert wrong.status_code == 403
    assert "does not match" in wrong.json()["detail"]

    tampered = body.replace(b'"3"', b'"4"')
    assert client.post(PATH, content=tampered, headers=headers).status_code == 403

    stale_body, stale = _signed(_alias_body("refused-model"), age_s=3600)
    refused = client.post(PATH, content=stale_body, headers=stale)
    assert refused.status_code == 403
    assert "stale" in refused.json()["detail"]

    garbage, garbage_headers = b"not json", dict(headers)
    garbage_headers[WEBHOOK_SIGNATURE_HEADER] = _generate_hmac_signature(
        SECRET, headers[WEBHOOK_DELIVERY_ID_HEADER], headers[WEBHOOK_TIMESTAMP_HEADER], "not json"
    )
    assert client.post(PATH, content=garbage, headers=garbage_headers).status_code == 400

    assert client.get("/health").json() == {"status": "ok"}


def test_a_signed_body_nested_too_deep_is_refused_not_a_server_error() -> None:
    """30,000 levels in 60 KB, under the 64 KiB cap: json.loads would recurse into a
    RecursionError (a 500 and a traceback in the log); it is a 400 like any bad payload."""
    depth = 30_000
    nested = '{"entity": "model_version_alias", "action": "created", "data": '
    body, headers = _signed(nested + "[" * depth + "]" * depth + "}")
    assert len(body) <= MAX_BODY_BYTES
    refused = TestClient(create_app(SECRET)).post(PATH, content=body, headers=headers)
    assert refused.status_code == 400, refused.text
    assert "not an MLflow webhook payload" in refused.json()["detail"]


def test_the_receiver_needs_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IMAGEOPS_WEBHOOK_SECRET", raising=False)
    with pytest.raises(ImageOpsError, match="IMAGEOPS_WEBHOOK_SECRET"):
        create_app()
    monkeypatch.setenv("IMAGEOPS_WEBHOOK_SECRET", SECRET)
    assert create_app().title  # from the settings


def test_only_an_mlflow_server_can_have_the_webhook(project: Settings) -> None:
    with pytest.raises(ImageOpsError, match=r"not an MLflow server.*promote step emit"):
        webhook.register_webhook("http://127.0.0.1:1/mlflow/webhook", secret=SECRET)


def test_a_signed_alias_delivery_becomes_one_prefect_event(prefect_api: None) -> None:
    client = TestClient(create_app(SECRET))
    name = f"model-{uuid.uuid4().hex[:8]}"
    body, headers = _signed(_alias_body(name, version="3"))

    answer = client.post(PATH, content=body, headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "emitted"
    # MLflow re-delivering the same delivery (its retry) does not make a second event.
    assert client.post(PATH, content=body, headers=headers).json()["status"] == "duplicate"
    # MLflow's "test webhook" delivery and other events are acknowledged, never forwarded.
    test_ping = dict(_alias_body(name), data=dict(ModelVersionAliasCreatedPayload.example()))
    assert client.post(PATH, content=(p := _signed(test_ping))[0], headers=p[1]).json() == {
        "status": "test",
        "delivery_id": p[1][WEBHOOK_DELIVERY_ID_HEADER],
    }
    created = dict(_alias_body(name), entity="model_version")
    answer = client.post(PATH, content=(c := _signed(created))[0], headers=c[1])
    assert answer.json()["status"] == "ignored"

    (event,) = _events(model_resource_id(name), want=1)
    assert event["id"] == headers[WEBHOOK_DELIVERY_ID_HEADER]
    assert event["resource"] == {
        "prefect.resource.id": f"mlflow.registered_model.{name}",
        "prefect.resource.name": name,
        "mlflow.registered_model.name": name,
        "mlflow.alias": "champion",
        "mlflow.model_version": "3",
    }
    assert event["payload"]["model_uri"] == f"models:/{name}@champion"
    assert event["payload"]["version_uri"] == f"models:/{name}/3"
    assert event["payload"]["source"] == "mlflow-webhook"


def test_when_prefect_is_down_mlflow_is_told_to_deliver_again() -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    client = TestClient(create_app(SECRET))
    body, headers = _signed(_alias_body("model-while-down"))
    with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api"}):
        answer = client.post(PATH, content=body, headers=headers)
    assert answer.status_code == 503  # MLflow retries 5xx
    assert "Prefect did not take the event" in answer.json()["detail"]


def test_embedded_promotion_emits_the_same_event(prefect_api: None) -> None:
    name = f"model-{uuid.uuid4().hex[:8]}"
    emitted = emit_alias_event(name, "champion", 5)
    assert emitted is not None
    (event,) = _events(model_resource_id(name), want=1)
    assert event["event"] == ALIAS_CREATED_EVENT
    assert event["resource"]["mlflow.model_version"] == "5"
    assert event["payload"]["source"] == "imageops"
    with pytest.raises(ImageOpsError, match="version number"):
        emit_alias_event(name, "champion", "latest")


def test_without_a_prefect_server_nothing_is_emitted() -> None:
    """No API and no run: no triggers anywhere to react, so no ephemeral API is started for it."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert emit_alias_event("some-model", "champion", 1) is None


def test_the_prefect_yaml_trigger_is_the_python_trigger() -> None:
    from prefect.events import DeploymentTriggerTypes
    from pydantic import TypeAdapter

    from flows.score import promotion_trigger

    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    (deployment,) = [d for d in spec["deployments"] if d["name"] == "score"]
    assert deployment["entrypoint"] == "flows.score.score_flow"
    (trigger,) = deployment["triggers"]
    # Read as `prefect deploy` reads it.
    from_yaml = TypeAdapter(DeploymentTriggerTypes).validate_python(trigger)
    assert from_yaml.model_dump() == promotion_trigger(NAME).model_dump()
    # the version the event names, on the team's cluster where the worker's machine has one
    assert from_yaml.parameters == {"model": "{{ event.payload.version_uri }}", "cluster": "team"}


# --- the whole chain, with real servers -------------------------------------------------------


@pytest.mark.slow
def test_an_alias_set_through_mlflow_rest_runs_the_scoring_deployment(
    processes: Processes,
    tmp_path: Path,
    exported_model: Path,
    digits_split: tuple[Path, Path],
) -> None:
    from cryptography.fernet import Fernet
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId

    bin_dir = Path(sys.executable).parent
    prefect_port, mlflow_port, receiver_port = free_port(), free_port(), free_port()
    prefect_api = f"http://127.0.0.1:{prefect_port}/api"

    @contextmanager
    def prefect_client() -> Iterator[Any]:  # Prefect's own client, on this test's server
        with (
            prefect_api_at(prefect_api),
            get_client(sync_client=True) as client,
        ):
            yield client

    mlflow_url = f"http://127.0.0.1:{mlflow_port}"
    receiver = f"http://127.0.0.1:{receiver_port}"
    base = base_env()

    # The project every imageops process shares: its home, the MLflow server, the Prefect server.
    project_root = tmp_path / "project"
    project_root.mkdir()
    imageops = {
        "IMAGEOPS_PROJECT_ROOT": str(project_root),
        "IMAGEOPS_HOME": str(project_root / ".imageops"),
        "IMAGEOPS_MLFLOW_TRACKING_URI": mlflow_url,
        "IMAGEOPS_PREFECT_API_URL": prefect_api,
        "PREFECT_API_URL": prefect_api,
        "PREFECT_HOME": str(project_root / ".imageops" / "prefect"),
    }
    # Everything that needs no other server starts at once, so the start-ups overlap; the
    # databases from the migrated templates, as `imageops serve` does.
    seed("prefect", tmp_path / "prefect-home" / "prefect.db")
    seed("mlflow", tmp_path / "mlflow.db")
    processes.start(
        "prefect-server",
        [str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1",
         "--port", str(prefect_port), "--no-ui", "--no-scheduler", "--no-late-runs"],
        base | {"PREFECT_HOME": str(tmp_path / "prefect-home")},
    )  # fmt: skip
    processes.start(
        "mlflow-server",
        [str(bin_dir / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(mlflow_port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
         "--artifacts-destination", str(tmp_path / "mlflow-artifacts")],
        base
        | {
            # A receiver on http://127.0.0.1 is refused unless both are allowed (SSRF guard).
            "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https",
            "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
            # One fixed key, or each server worker encrypts webhook secrets with its own.
            "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY": Fernet.generate_key().decode(),
        },
    )  # fmt: skip
    processes.start(
        "receiver",
        [sys.executable, "-m", "app.webhook", "serve", "--port", str(receiver_port)],
        base | imageops | {"IMAGEOPS_WEBHOOK_SECRET": SECRET},
    )
    processes.wait("the Prefect server", lambda: healthy(f"{prefect_api}/health"))
    val = digits_split[1]
    scores = tmp_path / "scores.csv"
    processes.start(
        "score-deployment",
        [sys.executable, "-m", "flows.score", "serve", "--images", str(val), "--dest", str(scores)],
        base | imageops | {"PREFECT_RUNNER_POLL_FREQUENCY": "1"},
    )
    processes.wait("the MLflow server", lambda: healthy(f"{mlflow_url}/health"))
    processes.wait("the receiver", lambda: healthy(f"{receiver}/health"))

    def automation() -> Any:
        with prefect_client() as client:
            found = client.read_automations_by_name(f"{NAME}@champion promoted")
        return found[0] if found else None

    trigger = processes.wait("the scoring deployment's trigger", automation)
    deployment_id = trigger.actions[0].deployment_id

    # The webhook, created through MLflow's client; MLflow's test delivery must get through.
    webhook.register_webhook(f"{receiver}{PATH}", secret=SECRET, mlflow_url=mlflow_url)

    # A version, registered against the server (artifacts go through its artifact proxy) ...
    import mlflow

    from tasks.registry.register import register

    settings = Settings(
        project_root=project_root, home=project_root / ".imageops", mlflow_tracking_uri=mlflow_url
    )
    try:
        versions = [register(exported_model, settings=settings).version for _ in range(2)]
    finally:
        mlflow.set_tracking_uri(None)  # other tests must not talk to this server
        mlflow.set_registry_uri(None)
    # ... and promoted through MLflow's REST API, as any other tool would: twice, at once. Each
    # promotion must score its own version (not whatever @champion is when its run starts).
    for version in versions:
        answer = httpx.post(
            f"{mlflow_url}/api/2.0/mlflow/registered-models/alias",
            json={"name": NAME, "alias": "champion", "version": str(version)},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text

    def finished_runs() -> Any:
        query = FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]))
        with prefect_client() as client:
            runs = client.read_flow_runs(flow_run_filter=query)
        for run in runs:
            if run.state_type.value in {"FAILED", "CRASHED", "CANCELLED"}:
                pytest.fail(f"scoring run ended {run.state_type.value}\n{processes.report()}")
        done = [r for r in runs if r.state_type.value == "COMPLETED"]
        return done if len(done) == len(versions) else None

    runs = processes.wait("two completed scoring runs", finished_runs, timeout_s=300)
    assert sorted(run.parameters["model"] for run in runs) == [
        f"models:/{NAME}/{version}" for version in sorted(versions)
    ]
    # cluster=team, and this machine is in no team: scored here, as before teams (on a team's
    # machine: tests/test_cluster.py::test_a_promotion_on_a_team_scores_on_its_cluster)
    assert [run.parameters["cluster"] for run in runs] == ["team", "team"]
    served = (processes.logs / "score-deployment.log").read_text()
    assert served.count("cluster=team: this machine is in no team") == 2, served
    table = pd.read_csv(scores)
    assert len(table) == len(read_manifest(val).images)
    for version in versions:
        cached = project_root / ".imageops" / "registry-cache" / NAME / str(version)
        assert (cached / "model.onnx").is_file()

    # Both moves were by hand (MLflow's REST API): the receiver left true tags on both versions.
    def champion_tags() -> Any:
        get = f"{mlflow_url}/api/2.0/mlflow/model-versions/get"
        found = [
            httpx.get(get, params={"name": NAME, "version": str(v)}, timeout=30).json()
            for v in versions
        ]
        tags = [{t["key"]: t["value"] for t in f["model_version"].get("tags", [])} for f in found]
        return tags if tags[0].get("champion.record", "").startswith("no") else None

    first, second = processes.wait("the champion tags", champion_tags, timeout_s=60)
    assert (first["champion"], second["champion"]) == (f"before v{versions[1]}", "yes")
    first, second = first["champion.record"], second["champion.record"]
    assert first.endswith(f"(by hand in the MLflow registry); then v{versions[1]}")
    assert second.startswith("yes, since ")
    assert second.endswith("(by hand in the MLflow registry)")
    # The times are the events': the first lost the alias when the second took it (issue 47).
    took = second.removeprefix("yes, since ").split(" (")[0]
    assert f" to {took} (" in first
    receiver_log = (processes.logs / "receiver.log").read_text()
    assert "MLflow webhook test delivery" in receiver_log
    for version in versions:
        assert f"{NAME}@champion -> version {version}: emitted" in receiver_log
