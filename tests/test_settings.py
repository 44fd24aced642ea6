"""Settings: one object says where everything lives; environment variables change it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.shared.settings import Settings


def test_defaults_live_under_the_project_working_folder(tmp_path: Path) -> None:
    s = Settings(project_root=tmp_path)
    assert s.home_dir == tmp_path / ".imageops"
    assert s.tracking_uri == f"sqlite:///{tmp_path / '.imageops' / 'mlflow.db'}"
    assert s.registry_uri == s.tracking_uri
    assert s.dvc_remote == str(tmp_path / ".imageops" / "dvc-remote")
    assert s.torch_home == tmp_path / ".imageops" / "torch"
    assert s.data_path == tmp_path / "data"
    env = s.environment()
    assert env["PREFECT_HOME"] == str(tmp_path / ".imageops" / "prefect")
    assert env["MLFLOW_TRACKING_URI"] == s.tracking_uri
    assert "PREFECT_API_URL" not in env  # embedded: Prefect's ephemeral API
    assert env["DVC_NO_ANALYTICS"] == "1"


def test_servers_for_scale_out_are_only_other_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IMAGEOPS_PROJECT_ROOT", str(tmp_path))
    monkeypatch.setenv("IMAGEOPS_MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    monkeypatch.setenv("IMAGEOPS_PREFECT_API_URL", "http://127.0.0.1:4200/api")
    monkeypatch.setenv("IMAGEOPS_DVC_REMOTE_URL", "s3://bucket/imageops")
    s = Settings()
    assert s.tracking_uri == "http://127.0.0.1:5000"
    assert s.dvc_remote == "s3://bucket/imageops"
    assert s.environment()["PREFECT_API_URL"] == "http://127.0.0.1:4200/api"


def test_unknown_setting_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mlflow_uri"):
        Settings(project_root=tmp_path, mlflow_uri="x")  # type: ignore[call-arg]


def test_an_s3_endpoint_reaches_every_s3_client_and_the_keys_stay_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IMAGEOPS_S3_ENDPOINT_URL", "http://10.0.0.1:8333")
    monkeypatch.setenv("IMAGEOPS_CHECKPOINT_URL", "s3://team/checkpoints")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-setting")
    env = Settings(project_root=tmp_path).environment()
    assert env["AWS_ENDPOINT_URL"] == env["MLFLOW_S3_ENDPOINT_URL"] == "http://10.0.0.1:8333"
    assert env["IMAGEOPS_S3_ENDPOINT_URL"] == "http://10.0.0.1:8333"
    assert env["IMAGEOPS_CHECKPOINT_URL"] == "s3://team/checkpoints"
    assert "not-a-setting" not in env.values()
    local = Settings(project_root=tmp_path, s3_endpoint_url=None, checkpoint_url=None)
    assert "AWS_ENDPOINT_URL" not in local.environment() and local.checkpoint_url is None


def test_imageops_commands_send_the_local_stacks_auth_string_only_to_a_loopback_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`imageops serve` keeps its Prefect auth string in <home>/stack (issue 43); the project's
    own commands send it to that API, never to another machine's, and a shell's own wins."""
    monkeypatch.delenv("PREFECT_API_AUTH_STRING", raising=False)
    local = Settings(project_root=tmp_path, prefect_api_url="http://127.0.0.1:4200/api")
    assert "PREFECT_API_AUTH_STRING" not in local.environment()  # no stack served yet
    local.prefect_auth_file.parent.mkdir(parents=True)
    local.prefect_auth_file.write_text("imageops:kept\n")
    assert local.environment()["PREFECT_API_AUTH_STRING"] == "imageops:kept"
    remote = Settings(project_root=tmp_path, prefect_api_url="http://10.0.0.5:4200/api")
    assert "PREFECT_API_AUTH_STRING" not in remote.environment()
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "imageops:exported")
    assert "PREFECT_API_AUTH_STRING" not in local.environment()  # the exported one is used
