"""Promotion starts scoring: MLflow's registry webhook, verified, becomes a Prefect event.

Prefect open-source has no inbound webhooks, so this receiver checks the signature and timestamp
MLflow's server sends (HMAC-SHA256) and emits the event of :mod:`tasks.registry.promotion_events`
that the scoring deployment's trigger (:mod:`flows.score`) runs on. In embedded mode the promote
step emits it itself. How to run it, and what it answers: docs/promotion.md#webhook-receiver.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import hmac
import logging
import threading
import time
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from models.bounded_parse import parse_json
from tasks.shared.errors import ImageOpsError, RegistryError, error_text
from tasks.shared.settings import Settings, get_settings, redact_uri

# MLflow's header names and signature version (mlflow.webhooks.constants).
SIGNATURE_HEADER = "X-MLflow-Signature"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
DELIVERY_ID_HEADER = "X-MLflow-Delivery-Id"
SIGNATURE_VERSION = "v1"
PATH = "/mlflow/webhook"
DEFAULT_PORT = 8765
WEBHOOK_NAME = "imageops-promotion"
ALIAS_CREATED = ("model_version_alias", "created")
TOLERANCE_S = 300  # replay window: MLflow's retries of one delivery finish well inside it
MAX_BODY_BYTES = 64 * 1024  # an alias payload is a few hundred bytes
# What MLflow's "test webhook" sends for this event (ModelVersionAliasCreatedPayload.example()).
MLFLOW_TEST_PAYLOAD = {"name": "example_model", "alias": "example_alias", "version": "1"}

log = logging.getLogger("imageops.webhook")


def sign(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    """The signature MLflow sends for ``body``: ``v1,`` + base64 HMAC-SHA256 of id.ts.body."""
    signed = delivery_id.encode() + b"." + timestamp.encode() + b"." + body
    digest = hmac.new(secret.encode(), signed, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(digest).decode()}"


def signature_matches(
    secret: str, delivery_id: str, timestamp: str, body: bytes, header: str
) -> bool:
    """True when one of the space-separated ``v1,...`` signatures in ``header`` is ours.

    Compared in constant time; several signatures are allowed so a secret can be rotated.
    """
    expected = sign(secret, delivery_id, timestamp, body)
    return any(hmac.compare_digest(expected, candidate) for candidate in header.split())


class _SeenDeliveries:
    """Delivery ids already turned into events, kept for the replay window (thread-safe)."""

    def __init__(self, ttl_s: float) -> None:
        self._ttl = ttl_s
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def __contains__(self, delivery_id: str) -> bool:
        with self._lock:
            now = time.monotonic()
            self._seen = {k: t for k, t in self._seen.items() if now - t < self._ttl}
            return delivery_id in self._seen

    def add(self, delivery_id: str) -> None:
        with self._lock:
            self._seen[delivery_id] = time.monotonic()


def _refuse(status: int, detail: str) -> JSONResponse:
    log.warning("refused webhook (%s): %s", status, detail)
    return JSONResponse({"detail": detail}, status_code=status)


def _secret(secret: str | None, settings: Settings | None) -> str:
    if secret:
        return secret
    configured = (settings or get_settings()).webhook_secret
    if configured is None or not configured.get_secret_value():
        raise ImageOpsError(
            "The webhook receiver has no secret: it would accept anyone's promotion.",
            "Set IMAGEOPS_WEBHOOK_SECRET (the same value the MLflow webhook was created with).",
        )
    return configured.get_secret_value()


def create_app(
    secret: str | None = None,
    *,
    settings: Settings | None = None,
    tolerance_s: int = TOLERANCE_S,
) -> FastAPI:
    """The receiver: ``POST /mlflow/webhook`` for MLflow, ``GET /health`` for probes.

    ``secret`` defaults to the settings' ``webhook_secret``; raises ImageOpsError when there is
    none. Prefect is reached through the API this process is configured for (PREFECT_API_URL).
    """
    secret = _secret(secret, settings)
    seen = _SeenDeliveries(2 * tolerance_s)
    app = FastAPI(title="imageops MLflow webhook receiver", docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post(PATH)
    async def receive(request: Request) -> JSONResponse:
        headers = request.headers
        missing = [
            h
            for h in (SIGNATURE_HEADER, TIMESTAMP_HEADER, DELIVERY_ID_HEADER)
            if not headers.get(h)
        ]
        if missing:
            return _refuse(
                401,
                f"missing {', '.join(missing)}: only signed MLflow webhooks are accepted "
                "(create the webhook with a secret).",
            )
        body = await _capped_body(request)
        if body is None:
            return _refuse(413, f"body over {MAX_BODY_BYTES} bytes, the most a payload may be.")
        delivery_id, timestamp = headers[DELIVERY_ID_HEADER], headers[TIMESTAMP_HEADER]
        if not signature_matches(secret, delivery_id, timestamp, body, headers[SIGNATURE_HEADER]):
            return _refuse(
                403,
                f"{SIGNATURE_HEADER} does not match: the webhook's secret is not this "
                "receiver's IMAGEOPS_WEBHOOK_SECRET.",
            )
        # Checked after the signature, so the timestamp is MLflow's and not an attacker's.
        try:
            age = time.time() - int(timestamp)
        except ValueError:
            return _refuse(400, f"{TIMESTAMP_HEADER} {timestamp!r} is not a Unix time.")
        if abs(age) > tolerance_s:
            return _refuse(
                403,
                f"{TIMESTAMP_HEADER} is {age:.0f} s from now (at most {tolerance_s} s): a stale "
                "or replayed delivery, or the two machines' clocks disagree.",
            )
        if delivery_id in seen:
            return JSONResponse({"status": "duplicate", "delivery_id": delivery_id})
        try:
            message: Any = parse_json(body)
            kind = (message["entity"], message["action"])
            data = message["data"]
        except (ValueError, KeyError, TypeError):
            return _refuse(400, "body is not an MLflow webhook payload (entity, action, data).")
        if kind != ALIAS_CREATED:
            return JSONResponse({"status": "ignored", "event": ".".join(map(str, kind))})
        if data == MLFLOW_TEST_PAYLOAD:
            log.info("MLflow webhook test delivery %s received", delivery_id)
            return JSONResponse({"status": "test", "delivery_id": delivery_id})
        return await _forward(data, delivery_id, int(timestamp), seen)

    return app


async def _capped_body(request: Request) -> bytes | None:
    """The body, or None when it is over MAX_BODY_BYTES: refused by its Content-Length before
    any of it is read, else reading stops at the cap (a chunked body declares no length)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            return None
    return bytes(body)


async def _forward(
    data: Any, delivery_id: str, timestamp: int, seen: _SeenDeliveries
) -> JSONResponse:
    """Emit the alias event for a verified delivery; 503 (MLflow retries) if Prefect is down.
    ``timestamp``: MLflow's time of the delivery, the move's time as the champion tags record it
    (the payload has none; MLflow delivers right after the move)."""
    # Imported here: Prefect reads its settings once, at import, and serve() exports ours first.
    from tasks.registry.promotion_events import alias_event, send_event

    try:
        event_id = UUID(delivery_id)
    except ValueError:
        event_id = None
    try:
        event = alias_event(
            str(data["name"]),
            str(data["alias"]),
            str(data["version"]),
            source="mlflow-webhook",
            event_id=event_id,
        )
    except (KeyError, TypeError, ImageOpsError) as exc:
        return _refuse(
            422, f"model_version_alias.created payload without name/alias/version: {exc}"
        )
    try:
        await send_event(event)
    except Exception as exc:  # any failure to hand over: let MLflow deliver again
        log.error("could not send %s to Prefect: %s", event.event, exc)
        return JSONResponse(
            {"detail": f"Prefect did not take the event: {type(exc).__name__}: {exc}"},
            status_code=503,
        )
    seen.add(delivery_id)
    moved_at = datetime.fromtimestamp(timestamp, UTC)
    await asyncio.to_thread(
        _record_champion, str(data["name"]), str(data["alias"]), int(data["version"]), moved_at
    )
    log.info(
        "%s@%s -> version %s: emitted %s (%s)",
        data["name"],
        data["alias"],
        data["version"],
        event.event,
        event.id,
    )
    return JSONResponse({"status": "emitted", "event": event.event, "event_id": str(event.id)})


_RECONCILING = threading.Lock()


def _record_champion(name: str, alias: str, version: int, moved_at: datetime) -> None:
    """The ``champion`` tags after a move of the alias (by hand, or the promote step's), with
    the move's version and time (tasks.registry.champion_record). A failure is logged, never
    refused: the scoring run is what the delivery is for, and the next move reconciles again."""
    if alias != "champion":
        return
    try:
        from mlflow.tracking import MlflowClient

        from tasks.registry.champion_record import reconcile

        settings = get_settings()
        client = MlflowClient(settings.tracking_uri, registry_uri=settings.registry_uri)
        with _RECONCILING:  # two deliveries at once would write the same tags at once
            reconcile(client, name, alias, moved_to=version, at=moved_at)
    except Exception as exc:
        log.warning("could not record %s@%s on the versions: %s: %s", name, alias,
                    type(exc).__name__, exc)  # fmt: skip


def serve(host: str = "127.0.0.1", port: int = DEFAULT_PORT, secret: str | None = None) -> None:
    """Run the receiver until interrupted. Needs a Prefect server (PREFECT_API_URL).

    Export the settings (``Settings.apply``) before this module's first Prefect import, as the
    ``imageops`` CLI and ``python -m app.webhook`` do.
    """
    import uvicorn
    from prefect.settings import PREFECT_API_URL

    app = create_app(secret)
    if not PREFECT_API_URL.value():
        raise ImageOpsError(
            "The webhook receiver needs a Prefect server, and PREFECT_API_URL is not set.",
            "Start `prefect server start` and set PREFECT_API_URL (or IMAGEOPS_PREFECT_API_URL) "
            "to its API, e.g. http://127.0.0.1:4200/api.",
        )
    log.info("receiving MLflow webhooks on http://%s:%s%s", host, port, PATH)
    uvicorn.run(app, host=host, port=port, log_level="info")


def register_webhook(
    receiver_url: str,
    *,
    secret: str | None = None,
    mlflow_url: str | None = None,
    name: str = WEBHOOK_NAME,
    test: bool = True,
) -> str:
    """Create (or update, by ``name``) the MLflow webhook that sends alias events to the receiver.

    ``mlflow_url`` defaults to the settings' tracking URI, which must be an ``mlflow server``;
    ``secret`` to IMAGEOPS_WEBHOOK_SECRET. With ``test``, MLflow sends its test delivery and a
    receiver that does not answer 2xx raises RegistryError naming why. Returns the webhook id.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    settings = get_settings()
    secret = _secret(secret, settings)
    url = mlflow_url or settings.tracking_uri
    if not url.startswith(("http://", "https://")):
        raise RegistryError(
            f"{redact_uri(url)} is not an MLflow server: only `mlflow server` sends webhooks.",
            "Set IMAGEOPS_MLFLOW_TRACKING_URI to the server (http://...), or, in embedded mode, "
            "let the promote step emit the event itself.",
        )
    client = MlflowClient(tracking_uri=url, registry_uri=url)
    events = ["model_version_alias.created"]
    description = "imageops: a promotion (alias set) starts the scoring deployment"
    try:
        existing = [w for w in client.list_webhooks(max_results=1000) if w.name == name]
        if existing:
            webhook = client.update_webhook(
                existing[0].webhook_id,
                url=receiver_url,
                events=events,
                secret=secret,
                description=description,
                status="ACTIVE",
            )
        else:
            webhook = client.create_webhook(
                name, receiver_url, events, description=description, secret=secret
            )
    except MlflowException as exc:
        raise RegistryError(
            f"MLflow at {redact_uri(url)} refused the webhook to {receiver_url}: "
            f"{redact_uri(exc.message)}",
            "For an http:// or private-address receiver, start the MLflow server with "
            "MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https and MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true; "
            "webhooks also need a SQL backend store.",
        ) from None  # MLflow's error echoes the URL, password included
    if test:
        result = client.test_webhook(webhook.webhook_id)
        if not result.success:
            raise RegistryError(
                f"MLflow's test delivery to {receiver_url} failed: "
                f"{result.error_message or f'{result.response_status} {result.response_body}'}",
                "Check the receiver runs (`imageops serve webhook`), that MLflow can reach "
                "it, and that both use the same IMAGEOPS_WEBHOOK_SECRET.",
            )
    return webhook.webhook_id


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app.webhook", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser("serve", help="run the receiver")
    serve_cmd.add_argument("--host", default="127.0.0.1")
    serve_cmd.add_argument("--port", type=int, default=DEFAULT_PORT)
    register_cmd = commands.add_parser("register", help="create the webhook in MLflow")
    register_cmd.add_argument("receiver_url", help=f"e.g. http://127.0.0.1:{DEFAULT_PORT}{PATH}")
    register_cmd.add_argument("--mlflow-url", default=None, help="default: the tracking URI")
    register_cmd.add_argument("--no-test", action="store_true", help="skip the test delivery")
    return parser


def main(argv: list[str] | None = None) -> None:
    """``python -m app.webhook serve|register``: the receiver and its webhook, without the CLI."""
    args = _parser().parse_args(argv)
    get_settings().apply()  # before anything imports Prefect
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command == "serve":
            serve(args.host, args.port)
        else:
            webhook_id = register_webhook(
                args.receiver_url, mlflow_url=args.mlflow_url, test=not args.no_test
            )
            print(f"webhook {webhook_id}: model_version_alias.created -> {args.receiver_url}")
    except ImageOpsError as exc:
        raise SystemExit(error_text(exc)) from None


if __name__ == "__main__":
    main()
