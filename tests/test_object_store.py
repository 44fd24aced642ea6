"""S3 for all that machines share, on a real SeaweedFS: DVC, fetch by md5, MLflow, checkpoints.

One SeaweedFS per test session (``s3_server`` in conftest), a bucket per test (``s3_bucket``),
real DVC pushes and fetches, a real ``mlflow server`` and boto3 to look inside the bucket.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import httpx
import pandas as pd
import psutil
import pytest
import torch
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import ClientError
from prefect_runs import artifacts_of, task_runs_of
from projects import imageops, use_project
from server_processes import ROOT, Processes, base_env, healthy

from tasks.data.imagedir import is_image_file, read_manifest
from tasks.data.versioning import REMOTE_NAME, ensure_dvc_repo, fetch_version, version
from tasks.inference.score import ERROR_COLUMN, LABEL_COLUMN, score_in_shards
from tasks.inference.score.s3_table import read_parts
from tasks.registry.model_uri import resolve_model
from tasks.registry.register import register
from tasks.shared import faults, servers
from tasks.shared.errors import DataUnavailableError, InvalidParameterError, ObjectStoreError
from tasks.shared.object_store import (
    ALL_ACTIONS,
    S3Server,
    S3Url,
    ensure_bucket,
    s3_client,
    start_seaweedfs,
)
from tasks.shared.servers import free_port
from tasks.shared.settings import Settings
from tasks.shared.tracking import configure_mlflow
from tasks.train.checkpoint import load_checkpoint, save_checkpoint
from tasks.train.checkpoint_store import download_checkpoint, upload_checkpoint
from tasks.train.run_folder import CHECKPOINT

pytest_plugins = ["model_fixtures"]


def _keys(server: S3Server, bucket: str, prefix: str = "") -> list[str]:
    client = s3_client(server.endpoint_url, server.access_key, server.secret_key)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


def _on_s3(
    project: Settings, server: S3Server, monkeypatch: pytest.MonkeyPatch, **settings: str
) -> Settings:
    """``project`` with the server's keys and endpoint in the environment, and ``settings``."""
    for key, value in server.environment().items():
        monkeypatch.setenv(key, value)
    for name, value in settings.items():
        monkeypatch.setenv(f"IMAGEOPS_{name.upper()}", value)
    return Settings()


# --- the server --------------------------------------------------------------------------------


def test_the_server_takes_its_keys_only_and_listens_on_its_host_only(
    s3_server: S3Server, s3_bucket: str
) -> None:
    s3_client(s3_server.endpoint_url, s3_server.access_key, s3_server.secret_key).put_object(
        Bucket=s3_bucket, Key="a/b.txt", Body=b"hello"
    )
    assert _keys(s3_server, s3_bucket) == ["a/b.txt"]

    region = {"region_name": "us-east-1", "endpoint_url": s3_server.endpoint_url}
    anonymous = boto3.client("s3", config=Config(signature_version=UNSIGNED), **region)
    for request in (
        lambda: anonymous.get_object(Bucket=s3_bucket, Key="a/b.txt"),
        lambda: anonymous.put_object(Bucket=s3_bucket, Key="c.txt", Body=b"x"),
        lambda: anonymous.list_objects_v2(Bucket=s3_bucket),
    ):
        with pytest.raises(ClientError, match="AccessDenied"):
            request()
    wrong = s3_client(s3_server.endpoint_url, s3_server.access_key, "not-the-secret")
    with pytest.raises(ClientError, match="SignatureDoesNotMatch"):
        wrong.get_object(Bucket=s3_bucket, Key="a/b.txt")

    listening = [
        c.laddr for c in psutil.Process(s3_server.pid).net_connections() if c.status == "LISTEN"
    ]
    assert len(listening) >= 7  # master, volume, filer, S3: HTTP and gRPC each
    assert {address.ip for address in listening} == {"127.0.0.1"}
    assert s3_server.environment()["AWS_ENDPOINT_URL"] == s3_server.endpoint_url
    assert s3_server.secret_key not in repr(s3_server)


def test_a_server_that_cannot_start_says_why_with_its_log(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ObjectStoreError, match="address already in use") as failed:
            start_seaweedfs(
                tmp_path / "s3", port=port, access_key="k", secret_key="s", start_timeout_s=60
            )
    assert str(port) in failed.value.hint and "seaweedfs.log" in failed.value.message


def test_a_server_started_again_on_its_folder_serves_what_it_stored(tmp_path: Path) -> None:
    keys = {"access_key": "team", "secret_key": "team-secret"}
    first = start_seaweedfs(tmp_path / "s3", **keys)
    try:
        ensure_bucket(first.endpoint_url, "kept", **keys)
        s3_client(first.endpoint_url, **keys).put_object(Bucket="kept", Key="k", Body=b"v")
    finally:
        first.stop(timeout_s=1)  # SIGKILLed: it ignores SIGTERM for 15 s
    assert not first.running()

    again = start_seaweedfs(tmp_path / "s3", **keys)
    try:
        # Readable at once, without the client's retries: it returned only once its volume server
        # serves the stored volumes again (on a loaded machine the listing answers seconds before).
        client = s3_client(again.endpoint_url, **keys, attempts=1)
        body = client.get_object(Bucket="kept", Key="k")["Body"]
        assert body.read() == b"v"
    finally:
        again.stop(timeout_s=1)
    assert (tmp_path / "s3" / "s3-identities.json").stat().st_mode & 0o777 == 0o600


# --- DVC ---------------------------------------------------------------------------------------


def test_an_s3_dvc_remote_gets_its_endpoint_and_the_pushed_version(
    project: Settings,
    s3_server: S3Server,
    s3_bucket: str,
    digits_split: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = _on_s3(project, s3_server, monkeypatch, dvc_remote_url=f"s3://{s3_bucket}/dvc")
    with ensure_dvc_repo(settings) as repo, repo.config.edit("local") as conf:
        conf["remote"][REMOTE_NAME]["region"] = "us-east-1"  # a user's own option
    data = settings.data_path / "train"
    shutil.copytree(digits_split[0], data)

    done = imageops("version", "data/train", cwd=settings.project_root)  # as a user runs it

    assert done.returncode == 0, done.stdout + done.stderr
    name, _, md5 = done.stdout.split()[0].partition("@")  # the reference: train@<md5>
    assert name == "train"
    objects = _keys(s3_server, s3_bucket, "dvc/files/")
    assert f"dvc/files/md5/{md5[:2]}/{md5[2:]}" in objects
    assert len(objects) == 1 + sum(1 for p in data.rglob("*") if p.is_file())
    # Its tag, in the remote beside the data: any machine sharing the bucket reads train@latest.
    assert _keys(s3_server, s3_bucket, "dvc/imageops/") == ["dvc/imageops/tags/train/latest"]
    with ensure_dvc_repo(settings) as repo:
        remote = repo.config["remote"][REMOTE_NAME]
    assert remote["url"] == f"s3://{s3_bucket}/dvc"
    assert remote["endpointurl"] == s3_server.endpoint_url
    assert remote["region"] == "us-east-1"

    # Back to a folder: the S3 options go (DVC refuses them on a folder remote), it versions.
    monkeypatch.setenv("IMAGEOPS_DVC_REMOTE_URL", str(settings.home_dir / "remote"))
    assert version(data, Settings()) == md5
    with ensure_dvc_repo(Settings()) as repo:
        written = repo.config.read("local")["remote"][REMOTE_NAME]
    assert written == {"url": str(settings.home_dir / "remote")}


# --- a version by md5 on a machine without the data --------------------------------------------


def _pushed(settings: Settings, source: Path) -> str:
    data = settings.data_path / "train"
    shutil.copytree(source, data)
    return version(data, settings)


def _assert_same_image_directory(fetched: Path, source: Path) -> None:
    manifest = read_manifest(fetched)
    assert manifest == read_manifest(source)
    for entry in manifest.images:
        assert (fetched / entry.path).read_bytes() == (source / entry.path).read_bytes()


@pytest.mark.parametrize("remote", ["s3", "folder"])
def test_another_host_fetches_a_version_by_md5_once(
    remote: str,
    project: Settings,
    s3_server: S3Server,
    s3_bucket: str,
    digits_split: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = f"s3://{s3_bucket}/dvc" if remote == "s3" else str(tmp_path / "remote")
    settings = _on_s3(project, s3_server, monkeypatch, dvc_remote_url=url)
    md5 = _pushed(settings, digits_split[0])

    other = use_project(tmp_path / "other-host", monkeypatch)
    fetched = fetch_version(md5, other)

    assert fetched.is_relative_to(other.home_dir)
    _assert_same_image_directory(fetched, digits_split[0])
    # Once fetched, no remote is asked: a remote that is not there does not matter.
    monkeypatch.setenv("IMAGEOPS_DVC_REMOTE_URL", str(tmp_path / "gone"))
    assert fetch_version(md5, Settings()) == fetched
    assert not (tmp_path / "gone").exists()


def test_two_fetches_at_once_take_turns_and_agree(
    project: Settings,
    digits_split: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("IMAGEOPS_DVC_REMOTE_URL", str(tmp_path / "remote"))
    md5 = _pushed(Settings(), digits_split[1])
    other = use_project(tmp_path / "other-host", monkeypatch)

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: fetch_version(md5, other), range(2))

    assert first == second
    _assert_same_image_directory(first, digits_split[1])
    assert [p.name for p in first.parent.iterdir() if not p.name.startswith(".")] == [first.name]


def test_a_fetch_killed_before_its_rename_leaves_nothing_that_looks_fetched(
    project: Settings,
    digits_split: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("IMAGEOPS_DVC_REMOTE_URL", str(tmp_path / "remote"))
    md5 = _pushed(Settings(), digits_split[1])
    other = use_project(tmp_path / "other-host", monkeypatch)
    fetch = f"from tasks.data.versioning import fetch_version; fetch_version({md5!r})"
    env = os.environ | {"PYTHONPATH": str(ROOT), faults.FAULT: "data.version_checked_out:kill"}

    killed = subprocess.run([sys.executable, "-c", fetch], env=env, timeout=120, check=False)

    assert killed.returncode == -signal.SIGKILL
    versions = other.home_dir / "data-versions"
    assert [p.name for p in versions.iterdir() if not p.name.startswith(".")] == []
    assert any(versions.glob(".*.tmp"))  # the checkout it was killed after
    fetched = fetch_version(md5, other)
    _assert_same_image_directory(fetched, digits_split[1])
    assert not any(versions.glob(".*.tmp*"))  # the dead fetch's folder and .dvc file are gone


def test_a_version_the_remote_does_not_have_is_named_with_remote_and_host(
    project: Settings, s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _on_s3(project, s3_server, monkeypatch, dvc_remote_url=f"s3://{s3_bucket}/dvc")
    md5 = "0123456789abcdef0123456789abcdef.dir"

    with pytest.raises(DataUnavailableError) as missing:
        fetch_version(md5, settings)

    message = missing.value.message
    assert md5 in message and f"s3://{s3_bucket}/dvc" in message
    assert socket.gethostname() in message and "imageops version" in missing.value.hint
    assert not any((settings.home_dir / "data-versions").glob("0123*"))
    with pytest.raises(InvalidParameterError, match="32 hex"):
        fetch_version("data/train", settings)


def test_an_unreachable_remote_is_named_with_its_password_masked(
    project: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote = f"http://user:hunter2@127.0.0.1:{free_port()}/dvc"  # nobody listens there
    monkeypatch.setenv("IMAGEOPS_DVC_REMOTE_URL", remote)

    with pytest.raises(DataUnavailableError) as unreachable:
        fetch_version("0123456789abcdef0123456789abcdef.dir", Settings())

    assert remote.replace("hunter2", "***") in unreachable.value.message
    assert "hunter2" not in str(unreachable.value)


# --- MLflow artifacts --------------------------------------------------------------------------


def test_an_mlflow_server_keeps_logged_models_in_s3_for_every_host(
    project: Settings,
    s3_server: S3Server,
    s3_bucket: str,
    exported_model: Path,
    processes: Processes,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = [
        str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
        "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
        "--artifacts-destination", f"s3://{s3_bucket}/mlartifacts", "--serve-artifacts",
    ]  # fmt: skip
    # Only the server holds the S3 keys: clients send artifacts through it.
    server_env = base_env() | s3_server.environment()
    processes.start("mlflow-server", server, server_env)
    for key in s3_server.environment():
        monkeypatch.delenv(key, raising=False)
    processes.wait("the MLflow server", lambda: healthy(f"{url}/health"))
    monkeypatch.setenv("IMAGEOPS_MLFLOW_TRACKING_URI", url)
    tracked = Settings()

    registered = register(exported_model, settings=tracked)
    experiment = configure_mlflow(tracked)  # the server chose its artifact location

    keys = _keys(s3_server, s3_bucket, f"mlartifacts/{experiment}/")
    assert any(k.endswith("/model.onnx") for k in keys), keys
    assert any(k.endswith("/model.json") for k in keys), keys
    other = use_project(tmp_path / "other-host", monkeypatch)
    monkeypatch.setenv("IMAGEOPS_MLFLOW_TRACKING_URI", url)
    scored_from = resolve_model(registered.model_uri, Settings())
    assert scored_from.is_relative_to(other.home_dir)
    assert (scored_from / "model.onnx").read_bytes() == (exported_model / "model.onnx").read_bytes()


# --- checkpoints -------------------------------------------------------------------------------


@pytest.mark.parametrize("store", ["s3", "folder"])
def test_a_checkpoint_stored_on_one_host_resumes_on_another(
    store: str,
    project: Settings,
    s3_server: S3Server,
    s3_bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = f"s3://{s3_bucket}/runs" if store == "s3" else str(tmp_path / "checkpoints")
    settings = _on_s3(project, s3_server, monkeypatch, checkpoint_url=url)
    local = save_checkpoint(
        tmp_path / "run" / CHECKPOINT, {"config_digest": "d1", "epoch": 2, "w": torch.ones(3)}
    )
    assert not download_checkpoint("run-1", tmp_path / "nothing.pt", settings)
    assert not (tmp_path / "nothing.pt").exists()

    upload_checkpoint(local, "run-1", settings)

    if store == "s3":
        assert _keys(s3_server, s3_bucket) == [f"runs/run-1/{CHECKPOINT}"]
    else:
        assert (tmp_path / "checkpoints" / "run-1" / CHECKPOINT).is_file()
    other = use_project(tmp_path / "other-host", monkeypatch)
    resumed = other.runs_dir / "run-1" / CHECKPOINT
    resumed.parent.mkdir(parents=True)
    resumed.write_bytes(b"an older, broken checkpoint")
    assert download_checkpoint("run-1", resumed, Settings())
    state = load_checkpoint(resumed, "d1")
    assert state is not None and state["epoch"] == 2 and torch.equal(state["w"], torch.ones(3))
    assert [p.name for p in resumed.parent.iterdir()] == [CHECKPOINT]  # no temporary left


def test_without_a_checkpoint_url_checkpoints_stay_in_the_run_folder(
    project: Settings, tmp_path: Path
) -> None:
    local = tmp_path / CHECKPOINT
    local.write_bytes(b"weights")
    upload_checkpoint(local, "run-1", project)  # nothing to do, nothing raised
    assert not download_checkpoint("run-1", tmp_path / "copy.pt", project)
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT, "project"]


def test_a_checkpoint_store_that_refuses_or_is_not_there_is_named(
    project: Settings,
    s3_server: S3Server,
    s3_bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    local = tmp_path / CHECKPOINT
    local.write_bytes(b"weights")
    url = f"s3://{s3_bucket}/runs"
    dead = Settings(checkpoint_url=url, s3_endpoint_url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ObjectStoreError, match=f"{url}/run-1/{CHECKPOINT}") as unreachable:
        upload_checkpoint(local, "run-1", dead)
    assert "IMAGEOPS_S3_ENDPOINT_URL" in unreachable.value.hint

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")  # keys this server does not know
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "nothing")
    refused = Settings(checkpoint_url=url, s3_endpoint_url=s3_server.endpoint_url)
    with pytest.raises(ObjectStoreError, match="InvalidAccessKeyId"):
        download_checkpoint("run-1", tmp_path / "copy.pt", refused)
    assert not (tmp_path / "copy.pt").exists()
    with pytest.raises(InvalidParameterError, match="neither s3:// nor a folder"):
        upload_checkpoint(local, "run-1", Settings(checkpoint_url="gs://bucket/runs"))


# --- scoring from and to S3 --------------------------------------------------------------------


def _upload(server: S3Server, folder: Path, bucket: str, prefix: str) -> int:
    """Put every file below ``folder`` under ``s3://bucket/prefix/``; the bytes put."""
    client = s3_client(server.endpoint_url, server.access_key, server.secret_key)
    files = [p for p in folder.rglob("*") if p.is_file()]
    for path in files:
        client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")
    return sum(p.stat().st_size for p in files)


_WRITTEN: list[str] | None = (
    None  # while a test records them: the files this process opens to write
)


def _record_writes(event: str, args: tuple) -> None:
    if _WRITTEN is None or event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    mode, flags = args[1], args[2]
    if (isinstance(mode, str) and any(m in mode for m in "wax+")) or (
        isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR)
    ):
        _WRITTEN.append(os.fsdecode(args[0]))


sys.addaudithook(_record_writes)  # every open of this process, the C libraries' excepted


def test_an_s3_prefix_scored_into_s3_gives_the_local_folders_rows_and_copies_no_image(
    exported_model: Path,
    project: Settings,
    s3_server: S3Server,
    s3_bucket: str,
    digits_raw: Path,
    digits_split: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    global _WRITTEN
    _on_s3(project, s3_server, monkeypatch)
    sent = _upload(s3_server, digits_raw, s3_bucket, "raw/digits")
    _upload(s3_server, digits_split[1], s3_bucket, "imagedirs/val")  # labeled, by its manifest
    options = {"shard_images": 40, "batch_size": 16, "threads": 1}  # 90 images: 3 parts
    dest = S3Url(s3_bucket, "scores/raw")
    _WRITTEN = []
    try:
        assert score_in_shards(exported_model, S3Url(s3_bucket, "raw/digits"), dest, **options)
    finally:
        written, _WRITTEN = _WRITTEN, None
    # Nothing of the input reached the local disk: the only files written were the parts' own
    # tables, uploaded and removed (the largest local file of the run: one part).
    assert not [path for path in written if is_image_file(Path(path))], written
    assert any(".imageops-part-" in path for path in written)  # the hook sees our writes
    keys = _keys(s3_server, s3_bucket, "scores/")
    assert keys == ["scores/raw/_SUCCESS"] + [f"scores/raw/part-0000{i}.parquet" for i in range(3)]
    client = s3_client(s3_server.endpoint_url, s3_server.access_key, s3_server.secret_key)
    largest = max(client.head_object(Bucket=s3_bucket, Key=k)["ContentLength"] for k in keys)
    assert largest < sent / 3

    local = score_in_shards(exported_model, digits_raw, project.project_root / "raw.csv", **options)
    expected = pd.read_csv(
        local, dtype={ERROR_COLUMN: str, LABEL_COLUMN: str}, keep_default_na=False
    )
    got = pd.concat(read_parts(dest), ignore_index=True)
    assert len(got) == 90 and (got[ERROR_COLUMN] == "").all()
    pd.testing.assert_frame_equal(got, expected, check_exact=False, rtol=1e-6)
    # Only the columns asked for that the parts have (the scoring report's count reads three,
    # not the probabilities; an unlabelled table has no true label).
    asked = [LABEL_COLUMN, ERROR_COLUMN, "category", "no-such-column"]
    narrow = pd.concat(read_parts(dest, asked), ignore_index=True)
    kept = [c for c in got.columns if c in asked]
    assert ERROR_COLUMN in kept and LABEL_COLUMN in kept and list(narrow.columns) == kept
    pd.testing.assert_frame_equal(narrow, got[kept])

    # An ImageDirectory in S3: its manifest's order and classes, and CSV parts on request.
    csv_dest = S3Url(s3_bucket, "scores/val.csv")
    score_in_shards(exported_model, S3Url(s3_bucket, "imagedirs/val"), csv_dest, **options)
    text = [ERROR_COLUMN, LABEL_COLUMN, "category", "path"]
    got = pd.concat(read_parts(csv_dest, text=text), ignore_index=True)
    narrow = pd.concat(read_parts(csv_dest, ["path", "no-such-column"], text), ignore_index=True)
    assert list(narrow.columns) == ["path"] and narrow["path"].tolist() == got["path"].tolist()
    local = score_in_shards(exported_model, digits_split[1], project.project_root / "val.csv")
    expected = pd.read_csv(local, dtype=dict.fromkeys(text, str), keep_default_na=False)
    manifest = read_manifest(digits_split[1])
    assert got["category"].tolist() == [manifest.classes[e.label] for e in manifest.images]
    pd.testing.assert_frame_equal(got, expected, check_exact=False, rtol=1e-6)
    here = score_in_shards(
        exported_model, S3Url(s3_bucket, "imagedirs/val"), project.project_root / "val-s3.csv"
    )  # from S3 into a local table
    assert here.read_bytes() == local.read_bytes()


def test_a_missing_prefix_or_bucket_or_refused_keys_fail_in_one_line_with_nothing_written(
    exported_model: Path,
    project: Settings,
    s3_server: S3Server,
    s3_bucket: str,
    digits_raw: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _on_s3(project, s3_server, monkeypatch)
    _upload(s3_server, digits_raw, s3_bucket, "raw")
    uploaded = _keys(s3_server, s3_bucket)
    model, dest = str(exported_model), f"s3://{s3_bucket}/scores/"

    def error_line(done: subprocess.CompletedProcess[str]) -> str:
        assert done.returncode == 2, done.stdout + done.stderr
        assert "Traceback" not in done.stderr
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, done.stderr
        return errors[0]

    # As a user types it: a prefix that is not there. Then keys S3 refuses (a key it does not know,
    # as for a bucket the team's keys may not write) and a bucket that is not there.
    missing = error_line(imageops("score", model, f"s3://{s3_bucket}/typo", dest, cwd=tmp_path))
    assert f"ObjectStoreError: There is nothing under s3://{s3_bucket}/typo" in missing
    assert s3_server.endpoint_url in missing
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    with pytest.raises(ObjectStoreError, match="refused the keys") as refused:
        score_in_shards(exported_model, digits_raw, S3Url.parse(dest))
    assert f"s3://{s3_bucket}/scores" in refused.value.message
    assert s3_server.endpoint_url in refused.value.message
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    with pytest.raises(ObjectStoreError, match="has no bucket 'no-such-bucket'") as no_bucket:
        score_in_shards(exported_model, S3Url("no-such-bucket", "raw"), tmp_path / "out.csv")
    assert s3_server.endpoint_url in no_bucket.value.message

    # Keys S3 takes, for this bucket only, meeting a bucket they may not use (the team's keys and
    # someone else's bucket), as a user types it: the images there, then the table there.
    other = f"{s3_bucket}-other"
    ensure_bucket(s3_server.endpoint_url, other, s3_server.access_key, s3_server.secret_key)
    access, secret = _keys_for_one_bucket(s3_server, s3_bucket)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", access)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    denied = error_line(imageops("score", model, f"s3://{other}/raw", dest, cwd=tmp_path))
    assert f"Could not list s3://{other}/raw: S3 at {s3_server.endpoint_url} refused" in denied
    denied = error_line(
        imageops("score", model, f"s3://{s3_bucket}/raw", f"s3://{other}/scores", cwd=tmp_path)
    )
    assert f"under s3://{other}/scores/_temporary/" in denied and "(AccessDenied)" in denied
    assert _keys(s3_server, other) == []

    assert _keys(s3_server, s3_bucket) == uploaded  # nothing written, here or there
    assert list(tmp_path.iterdir()) == [project.project_root]


def _keys_for_one_bucket(server: S3Server, bucket: str) -> tuple[str, str]:
    """New keys that may list, read and write in ``bucket`` alone: a second identity in the
    filer's identity file, which the S3 gateway reloads (the filer's port is on its command
    line; the server's own identity is kept)."""
    command = psutil.Process(server.pid).cmdline()
    filer = next(arg.split("=", 1)[1] for arg in command if arg.startswith("-filer.port="))
    access, secret = f"one-{secrets.token_hex(4)}", secrets.token_urlsafe(24)
    identities = {"identities": [
        {"name": "imageops", "actions": ALL_ACTIONS,
         "credentials": [{"accessKey": server.access_key, "secretKey": server.secret_key}]},
        {"name": "one-bucket", "actions": [f"{a}:{bucket}" for a in ("List", "Read", "Write")],
         "credentials": [{"accessKey": access, "secretKey": secret}]},
    ]}  # fmt: skip
    answer = httpx.post(
        f"http://127.0.0.1:{filer}/etc/iam/identity.json",
        files={"file": ("identity.json", json.dumps(identities))},
    )
    answer.raise_for_status()
    client = s3_client(server.endpoint_url, access, secret, attempts=1)

    def taken() -> bool:
        try:
            client.list_objects_v2(Bucket=bucket, MaxKeys=1)
        except ClientError:
            return False
        return True

    assert servers.wait_until(taken, 30, interval_s=0.25), "S3 did not take the new identity"
    return access, secret


def test_a_scoring_into_s3_stopped_before_its_marker_shows_no_table_and_resumes(
    prefect_api: None,
    exported_model: Path,
    project: Settings,
    s3_server: S3Server,
    s3_bucket: str,
    digits_raw: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    from flows.score import SCORING_REPORT, score_flow

    _on_s3(project, s3_server, monkeypatch)
    _upload(s3_server, digits_raw, s3_bucket, "raw")
    images, dest = S3Url(s3_bucket, "raw"), S3Url(s3_bucket, "scores")
    options = {"shard_images": 40, "batch_size": 16, "threads": 1}  # 90 images: 3 parts

    # Stopped once its second part is uploaded: the two parts whole, in the temporary place only.
    monkeypatch.setenv(faults.FAULT, "score.shard_written:shard=1:raise")
    with pytest.raises(faults.InjectedFault):
        score_in_shards(exported_model, images, dest, **options)
    finished = _keys(s3_server, s3_bucket, "scores/")
    assert [k.rsplit("/", 1)[1] for k in finished] == ["part-00000.parquet", "part-00001.parquet"]
    assert all("/_temporary/" in k for k in finished)

    # The score flow, as the deployment runs it, on the same URLs: the missing part a Prefect
    # task, then stopped with every part in place but before the marker: still no whole table.
    flow_options = {"model": str(exported_model), "images": str(images), "dest": str(dest),
                    "shard_images": 40, "batch_size": 16}  # fmt: skip
    monkeypatch.setenv(faults.FAULT, "score.parts_published:raise")
    caplog.clear()
    capfd.readouterr()
    stopped = score_flow(**flow_options, return_state=True)
    assert stopped.is_failed() and "InjectedFault" in str(stopped.message)
    # The flow run's log: on this test's stderr, or as logging records when an earlier test's
    # Prefect handler holds the console.
    assert "Reusing 2 of 3 finished shards" in capfd.readouterr().err + caplog.text
    caplog.clear()
    (task,) = task_runs_of(stopped.state_details.flow_run_id, want=1)  # the missing part only
    assert task.state.is_completed()
    placed = [k for k in _keys(s3_server, s3_bucket, "scores/") if "/_temporary/" not in k]
    assert placed == [f"scores/part-0000{i}.parquet" for i in range(3)]  # no _SUCCESS

    monkeypatch.delenv(faults.FAULT)
    state = score_flow(**flow_options, return_state=True)
    assert state.result().scored == str(dest)
    assert "Reusing 3 of 3 finished shards" in capfd.readouterr().err + caplog.text
    assert _keys(s3_server, s3_bucket, "scores/") == ["scores/_SUCCESS", *placed]
    table = pd.concat(read_parts(dest), ignore_index=True)
    assert table["id"].tolist() == list(range(90))  # every image once
    assert (table[ERROR_COLUMN] == "").all()
    (report,) = artifacts_of(
        state.state_details.flow_run_id, SCORING_REPORT
    )  # the run's report, read from the parts
    assert "| rows | 90 |" in report.data and f"| table | `{dest}` |" in report.data
