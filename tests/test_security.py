"""Security: nothing unpickles user files, signatures are checked, passwords stay out of output,
servers listen on localhost unless told otherwise.

The code scan reads the source (AST), so it holds for every code path, tested or not. The other
checks run the real thing in-process: the CLI against an MLflow address that refuses connections,
the receiver through FastAPI's TestClient, the CLI's option parsing.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import logging
import os
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import typer
from fastapi.testclient import TestClient
from mlflow.webhooks.constants import (
    WEBHOOK_DELIVERY_ID_HEADER,
    WEBHOOK_SIGNATURE_HEADER,
    WEBHOOK_TIMESTAMP_HEADER,
)
from mlflow.webhooks.delivery import _generate_hmac_signature

from tasks.shared.settings import Settings, redact_uri

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("app", "flows", "tasks", "models", "bench", "docs")

# ---------------------------------------------------------------------------------------------
# 1. No code path deserialises a user's file into code.

# Calls that run code from the data they load, whatever their arguments: what to use instead.
_ALWAYS_UNSAFE = {
    "pickle.load": "JSON, safetensors or torch.load(..., weights_only=True)",
    "pickle.loads": "JSON, safetensors or torch.load(..., weights_only=True)",
    "pickle.Unpickler": "JSON, safetensors or torch.load(..., weights_only=True)",
    "_pickle.load": "JSON, safetensors or torch.load(..., weights_only=True)",
    "_pickle.loads": "JSON, safetensors or torch.load(..., weights_only=True)",
    "cloudpickle.load": "JSON or safetensors",
    "cloudpickle.loads": "JSON or safetensors",
    "dill.load": "JSON or safetensors",
    "dill.loads": "JSON or safetensors",
    "joblib.load": "JSON, safetensors or ONNX",
    "pandas.read_pickle": "pandas.read_csv / read_parquet",
    "marshal.load": "JSON",
    "marshal.loads": "JSON",
    "shelve.open": "JSON or SQLite",
    "yaml.unsafe_load": "yaml.safe_load",
    "yaml.full_load": "yaml.safe_load",
    "mlflow.pytorch.load_model": "the ONNX flavor (mlflow.onnx) or the registry cache",
    "mlflow.sklearn.load_model": "the ONNX flavor (mlflow.onnx)",
}
_SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _imports(tree: ast.AST) -> dict[str, str]:
    """Local name -> what it names: ``np`` -> ``numpy``, ``ld`` -> ``pickle.loads``."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                local = a.asname or a.name.split(".")[0]
                aliases[local] = a.name if a.asname else local
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def _safe_loaders(tree: ast.AST) -> set[str]:
    """The safe YAML loaders, with this file's classes that subclass one."""
    safe = set(_SAFE_YAML_LOADERS)
    for node in ast.walk(tree):
        bases = [(_dotted(b) or "").split(".")[-1] for b in getattr(node, "bases", [])]
        if isinstance(node, ast.ClassDef) and safe.intersection(bases):
            safe.add(node.name)
    return safe


def _why_unsafe(name: str, call: ast.Call, safe_loaders: set[str]) -> str | None:
    """What to use instead of this call, or None when it cannot run code from data."""
    if name in _ALWAYS_UNSAFE:
        return _ALWAYS_UNSAFE[name]
    if name == "torch.load" and not _is_true(_keyword(call, "weights_only")):
        return "torch.load(..., weights_only=True) or safetensors"
    if name in ("yaml.load", "yaml.load_all"):
        loader = _keyword(call, "Loader") or (call.args[1] if len(call.args) > 1 else None)
        if loader is None or (_dotted(loader) or "").split(".")[-1] not in safe_loaders:
            return "yaml.safe_load, or Loader=yaml.SafeLoader (or a subclass)"
    if name == "numpy.load":
        allow = _keyword(call, "allow_pickle")
        if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
            return "numpy.load(..., allow_pickle=False)"
    method = isinstance(call.func, ast.Attribute) and call.func.attr in ("extract", "extractall")
    if method and _keyword(call, "filter") is None:  # zipfile has no filter: always refused
        return 'tasks.data.archive.extract_archive (member by member, paths checked, filter="data")'
    return None


def unsafe_calls(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: call -- use instead`` for every call that can run code from loaded data."""
    tree = ast.parse(source, filename)
    aliases, safe_loaders = _imports(tree), _safe_loaders(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        head, _, rest = (_dotted(node.func) or "").partition(".")
        name = ".".join(filter(None, (aliases.get(head, head), rest)))
        instead = _why_unsafe(name, node, safe_loaders)
        if instead:
            found.append(f"{filename}:{node.lineno}: {name}(...) -- use {instead}")
    return sorted(found, key=lambda hit: int(hit.split(":")[1]))


def test_the_scanner_flags_unsafe_loads_and_passes_safe_ones() -> None:
    bad = """
import pickle, torch, yaml, tarfile, zipfile
import numpy as np
import pandas as pd
from pickle import loads as ld
import mlflow.pytorch
pickle.load(open("m.pkl", "rb"))
ld(b"")
torch.load("w.pt")
torch.load("w.pt", weights_only=False)
yaml.load(text)
yaml.load(text, Loader=yaml.Loader)
np.load("a.npy", allow_pickle=True)
pd.read_pickle("t.pkl")
tarfile.open("a.tar").extractall("out")
zipfile.ZipFile("a.zip").extractall("out")
mlflow.pytorch.load_model("models:/m/1")
"""
    found = unsafe_calls(bad, "bad.py")
    assert [f.split(":")[1] for f in found] == [str(n) for n in range(7, 18)], found
    assert "bad.py:9: torch.load(...) -- use torch.load(..., weights_only=True)" in found[2]
    good = """
import torch, yaml, tarfile
import numpy as np
class Strict(yaml.SafeLoader):
    pass
torch.load("w.pt", map_location="cpu", weights_only=True)
yaml.safe_load(text)
yaml.load(text, Loader=Strict)
np.load("a.npy")
tarfile.open("a.tar").extract(member, "out", filter="data")
"""
    assert unsafe_calls(good, "good.py") == []


def test_no_code_path_unpickles_or_extracts_unchecked() -> None:
    files = sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py"))
    assert any(f.name == "archive.py" for f in files)  # the scan reaches the code that matters
    found = [hit for f in files for hit in unsafe_calls(f.read_text(), str(f.relative_to(ROOT)))]
    assert not found, "unsafe deserialisation or extraction:\n" + "\n".join(found)


# ---------------------------------------------------------------------------------------------
# 2. The promotion receiver: what test_promotion_webhook.py does not already refuse.

SECRET = "security-secret-" + "y" * 20


def _delivery(
    *, age_s: int = 0, delivery_id: str | None = None, signed_id: str | None = None
) -> tuple[bytes, dict[str, str]]:
    body = {
        "entity": "model_version_alias",
        "action": "created",
        "timestamp": "2026-01-01T00:00:00+00:00",
        "data": {"name": "security-model", "alias": "champion", "version": "1"},
    }
    payload = json.dumps(body)
    delivery_id = delivery_id or str(uuid.uuid4())
    timestamp = str(int(time.time()) - age_s)
    signature = _generate_hmac_signature(SECRET, signed_id or delivery_id, timestamp, payload)
    return payload.encode(), {
        "Content-Type": "application/json",
        WEBHOOK_DELIVERY_ID_HEADER: delivery_id,
        WEBHOOK_TIMESTAMP_HEADER: timestamp,
        WEBHOOK_SIGNATURE_HEADER: signature,
    }


def test_the_receiver_refuses_future_relabelled_and_malformed_deliveries() -> None:
    from app.webhook import MAX_BODY_BYTES, PATH, create_app

    client = TestClient(create_app(SECRET))

    future_body, future = _delivery(age_s=-3600)  # a clock far ahead, or a pre-made replay
    answer = client.post(PATH, content=future_body, headers=future)
    assert answer.status_code == 403 and "stale" in answer.json()["detail"]

    # A captured signature under a new delivery id (to dodge de-duplication) does not verify.
    body, relabelled = _delivery(delivery_id=str(uuid.uuid4()), signed_id=str(uuid.uuid4()))
    assert client.post(PATH, content=body, headers=relabelled).status_code == 403

    # A stale delivery with a fresh timestamp header: the signature covers the timestamp.
    stale_body, stale = _delivery(age_s=3600)
    refreshed = {**stale, WEBHOOK_TIMESTAMP_HEADER: str(int(time.time()))}
    assert client.post(PATH, content=stale_body, headers=refreshed).status_code == 403

    for signature in ("", "v2," + stale[WEBHOOK_SIGNATURE_HEADER][3:], "v1,"):
        headers = {**future, WEBHOOK_SIGNATURE_HEADER: signature}
        assert client.post(PATH, content=future_body, headers=headers).status_code in (401, 403)

    huge, headers = b"{" + b" " * MAX_BODY_BYTES + b"}", _delivery()[1]
    assert client.post(PATH, content=huge, headers=headers).status_code == 413


def test_a_huge_unsigned_body_is_refused_before_it_fills_the_receivers_memory(
    tmp_path: Path,
) -> None:
    """600 MB, falsely signed, at the real receiver (`imageops serve webhook`): refused by its
    declared length
    before a byte is read, and a chunked body (no length) read no further than the cap; the
    process grows by less than 20 MB either way."""
    import socket

    import psutil

    from app.webhook import MAX_BODY_BYTES, PATH
    from tasks.shared import servers

    port = servers.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "IMAGEOPS_"))}
    env |= {"IMAGEOPS_WEBHOOK_SECRET": SECRET, "PREFECT_API_URL": "http://127.0.0.1:9/api",
            "IMAGEOPS_PROJECT_ROOT": str(tmp_path), "PYTHONPATH": str(ROOT)}  # fmt: skip
    receiver = servers.start(
        [sys.executable, "-m", "app.cli", "serve", "webhook", "--port", str(port)],
        tmp_path / "receiver.log", env,
    )  # fmt: skip
    try:
        assert servers.wait_until(
            lambda: servers.healthy(f"http://127.0.0.1:{port}/health", timeout_s=2), 60, 0.2
        ), (tmp_path / "receiver.log").read_text()
        process = psutil.Process(receiver.pid)
        before, peak, sending = process.memory_info().rss, [0], threading.Event()

        def watch() -> None:  # the receiver's largest size while the body is on its way
            while sending.is_set():
                peak[0] = max(peak[0], process.memory_info().rss)
                time.sleep(0.01)

        total, chunk = 600 * 2**20, b"x" * 2**20
        for chunked in (False, True):
            signed = _delivery()[1] | {WEBHOOK_SIGNATURE_HEADER: "v1,forged"}
            head = f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            head += "".join(f"{k}: {v}\r\n" for k, v in signed.items())
            head += "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {total}\r\n"
            sending.set()
            watcher = threading.Thread(target=watch)
            watcher.start()
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(head.encode() + b"\r\n")
                sent = 0
                with contextlib.suppress(OSError):  # the receiver may close once it has answered
                    while sent < total:
                        sock.sendall(b"100000\r\n" + chunk + b"\r\n" if chunked else chunk)
                        sent += len(chunk)
                    if chunked:
                        sock.sendall(b"0\r\n\r\n")
                answer = sock.recv(4096).decode(errors="replace")
            sending.clear()
            watcher.join()
            assert " 413 " in answer.splitlines()[0], answer
            grown = peak[0] - before
            assert grown < 20 * 2**20, f"receiver grew {grown / 2**20:.0f} MB (chunked={chunked})"
        assert MAX_BODY_BYTES < 2**20
    finally:
        servers.stop(receiver)


# ---------------------------------------------------------------------------------------------
# 3. Passwords in settings URIs never reach output, logs or files.


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("postgresql+psycopg://u:s3cret@db.example:5432/mlflow", "postgresql+psycopg://u:***@db.example:5432/mlflow"),
        ("https://u:s3cret@mlflow.example", "https://u:***@mlflow.example"),
        ("https://u:p@ss:w0rd@mlflow.example/x?a=b", "https://u:***@mlflow.example/x?a=b"),
        ("to http://u:s3cret@127.0.0.1:1/api failed", "to http://u:***@127.0.0.1:1/api failed"),
        ("a=postgresql://a:b@h1/d, b=http://c:d@h2", "a=postgresql://a:***@h1/d, b=http://c:***@h2"),
        ("https://token@github.example/x", "https://token@github.example/x"),
        ("https://mlflow.example:5000/#/models/a@b", "https://mlflow.example:5000/#/models/a@b"),
        ("sqlite:////home/me/.imageops/mlflow.db", "sqlite:////home/me/.imageops/mlflow.db"),
        ("s3://bucket/dvc", "s3://bucket/dvc"),
        ("not a URI: user:pw@host", "not a URI: user:pw@host"),
    ],
)  # fmt: skip
def test_redact_uri_masks_only_the_password(uri: str, shown: str) -> None:
    assert redact_uri(uri) == shown


def _leaks(folder: Path, secret: bytes) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and secret in p.read_bytes()]


def test_a_failing_registry_names_its_host_but_not_its_password(
    project: Settings,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    from app.cli import main

    uri = "http://imageops:s3cret@127.0.0.1:1"  # nothing listens on port 1: refused at once
    for var in ("IMAGEOPS_MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        monkeypatch.setenv(var, uri)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    # The model is resolved first: the images need not exist for the registry to be asked.
    args = ["imageops", "score", "models:/imageops-classifier@champion", "images", "out.csv"]
    monkeypatch.setattr(sys, "argv", args)
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    printed = capsys.readouterr()
    assert "s3cret" not in printed.out + printed.err + caplog.text
    assert "127.0.0.1:1" in printed.err and "imageops:***@" in printed.err
    assert "what to do:" in printed.err
    assert not _leaks(project.project_root, b"s3cret")


def test_reports_and_links_mask_the_tracking_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.cli.pipeline import _print_summary
    from flows.pipeline import PipelineResult, summary_markdown
    from tasks.shared.tracking import ui_url

    result = PipelineResult(
        dataset="digits",
        outputs=tmp_path,
        model_dir=tmp_path / "model",
        scored=tmp_path / "scored.csv",
        mlflow_run_id="0" * 32,
        registered_model="imageops-classifier",
        registered_version="1",
        champion=True,
        data_version={"train": "abc"},
        metrics={"val_top1": 0.5},
    )
    database = Settings(
        project_root=tmp_path, mlflow_tracking_uri="postgresql+psycopg://u:s3cret@db.example/ml"
    )
    report = summary_markdown(result, database)
    _print_summary(database, result)
    printed = capsys.readouterr().out
    for text in (report, printed):
        assert "s3cret" not in text and "u:***@db.example/ml" in text
    server = Settings(project_root=tmp_path, mlflow_tracking_uri="https://u:s3cret@ml.example")
    assert ui_url(server, "models/m") == (
        "https://u:***@ml.example/#/models/m?workflowType=machine_learning"
    )


def test_training_output_and_logs_mask_passwords(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """torchrun's output and the rank logs: a worker's traceback may quote MLflow's URL."""
    from tasks.shared.settings import RedactingFormatter
    from tasks.train.torchrun import _pump

    line = "MlflowException: API request to http://u:s3cret@ml.example/api/2.0 failed\n"
    _pump(io.StringIO(line), tmp_path / "torchrun.log")
    assert "s3cret" not in capsys.readouterr().out + (tmp_path / "torchrun.log").read_text()
    try:
        raise RuntimeError(line)
    except RuntimeError:
        record = logging.LogRecord("w", logging.ERROR, "", 0, "failed", (), sys.exc_info())
    logged = RedactingFormatter("%(message)s").format(record)
    assert "s3cret" not in logged and "http://u:***@ml.example" in logged


# ---------------------------------------------------------------------------------------------
# 4. Every server imageops starts listens on this machine only, unless told otherwise.
# Live checks elsewhere: tests/test_stack.py (Prefect server, MLflow server, receiver, worker of
# `imageops serve` listen on 127.0.0.1 only), tests/test_temporary_api.py (`imageops run`'s
# temporary Prefect API), tests/test_team.py (`imageops team server` on the address it is given,
# every server behind a login).


def _host_option(*path: str) -> tuple[str, str]:
    """(default, value after ``--host 0.0.0.0``) of the ``--host`` option of a CLI command."""
    from app.cli import app

    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    default = command.make_context(path[-1], []).params["host"]
    given = command.make_context(path[-1], ["--host", "0.0.0.0"]).params["host"]
    return default, given


@pytest.mark.parametrize("path", [("serve",), ("serve", "webhook"), ("team", "server")])
def test_served_commands_listen_on_localhost_by_default(path: tuple[str, ...]) -> None:
    assert _host_option(*path) == ("127.0.0.1", "0.0.0.0")


def test_library_servers_default_to_localhost() -> None:
    import inspect

    from prefect.settings import get_current_settings

    from app import webhook
    from app.stack import Stack
    from app.team import TeamServer
    from tasks.train.params import TrainParams
    from tasks.train.request import TrainRequest
    from tasks.train.torchrun import torchrun_command

    assert inspect.signature(webhook.serve).parameters["host"].default == "127.0.0.1"
    assert webhook._parser().parse_args(["serve"]).host == "127.0.0.1"  # python -m app.webhook
    assert webhook._parser().parse_args(["serve", "--host", "0.0.0.0"]).host == "0.0.0.0"
    assert inspect.signature(Stack).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(TeamServer).parameters["host"].default == "127.0.0.1"
    # `imageops serve scoring` runs Prefect's runner: its web server stays off, and would be local.
    runner = get_current_settings().runner.server
    assert runner.enable is False and runner.host in ("localhost", "127.0.0.1")
    # One-machine training: torchrun's rendezvous is its own, standalone, on this machine.
    request = TrainRequest(model=Path("m"), train_data=Path("t"), val_data=Path("v"),
                           out=Path("o"), params=TrainParams())  # fmt: skip
    command = torchrun_command(request, Path("config.json"), "run")
    assert "--standalone" in command and "--rdzv-endpoint" not in command
