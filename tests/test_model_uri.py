"""Models by registry URI: resolved on a real MLflow (SQLite), cached, scored like the original."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import mlflow.onnx
import onnx
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from models.directory import ONNX
from tasks.inference.score import score
from tasks.registry.model_uri import ORIGIN, cache_path, fetch_registered_model, resolve_model
from tasks.registry.register import DIRECTORY_ARTIFACTS, register
from tasks.shared.errors import RegistryError, RegistryUnreachableError
from tasks.shared.settings import Settings
from tasks.shared.tracking import configure_mlflow

pytest_plugins = ["model_fixtures"]

NAME = "imageops-classifier"


def _leftovers(folder: Path) -> list[str]:
    """Temporary folders a download left behind (there must be none)."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_alias_and_version_uris_give_a_cached_model_that_scores_like_the_original(
    project: Settings, exported_model: Path, digits_split: tuple[Path, Path], tmp_path: Path
) -> None:
    register(exported_model, settings=project, alias="champion")

    path = resolve_model(f"models:/{NAME}@champion", project)

    assert path == cache_path(project, NAME, 1)
    assert sorted(p.name for p in path.iterdir()) == ["model.json", ONNX, ORIGIN]
    assert (path / "model.json").read_bytes() == (exported_model / "model.json").read_bytes()
    assert (path / ONNX).read_bytes() == (exported_model / ONNX).read_bytes()
    assert _leftovers(path.parent) == []
    val = digits_split[1]
    expected = pd.read_csv(score(exported_model, val, tmp_path / "original.csv"))
    got = pd.read_csv(score(path, val, tmp_path / "registry.csv"))
    pd.testing.assert_frame_equal(got, expected)

    # The same version again, by alias or by number: the cache, not a second download.
    stamp = (path / ORIGIN).stat().st_mtime_ns
    again = fetch_registered_model(f"models:/{NAME}/1", project)
    assert (again.path, again.version, again.alias) == (path, 1, None)
    assert resolve_model(f"models:/{NAME}@champion", project) == path
    assert (path / ORIGIN).stat().st_mtime_ns == stamp

    # A promotion moves the alias: the next resolve follows it to the new version.
    register(exported_model, settings=project, alias="champion")
    assert resolve_model(f"models:/{NAME}@champion", project) == cache_path(project, NAME, 2)
    assert resolve_model(f"models:/{NAME}/1", project) == path

    with pytest.raises(RegistryError, match=r"has no alias @staging.*@champion -> v2"):
        resolve_model(f"models:/{NAME}@staging", project)
    with pytest.raises(RegistryError, match=r"has no version 7"):
        resolve_model(f"models:/{NAME}/7", project)


def test_a_path_is_returned_as_is_and_bad_uris_are_refused_with_a_hint(
    project: Settings, tmp_path: Path
) -> None:
    assert resolve_model(tmp_path / "model", project) == tmp_path / "model"
    assert resolve_model("relative/model", project) == Path("relative/model")
    with pytest.raises(RegistryError, match=r"not a model URI.*models:/<name>@<alias>"):
        resolve_model(f"models:/{NAME}/latest", project)
    configure_mlflow(project)  # an empty registry
    with pytest.raises(RegistryError, match=r"no registered model 'nope'.*imageops register"):
        resolve_model("models:/nope@champion", project)


def test_a_version_number_no_registry_can_hold_is_no_such_version(project: Settings) -> None:
    """Past MLflow's INTEGER column the registry fails, not answers: still "no such version",
    not a RegistryUnreachableError to retry; past int()'s digits, not a ValueError."""
    configure_mlflow(project)
    MlflowClient(project.tracking_uri, project.registry_uri).create_registered_model(NAME)
    huge = "99999999999999999999999"
    with pytest.raises(RegistryError, match=f"has no version {huge}") as refused:
        resolve_model(f"models:/{NAME}/{huge}", project)
    assert not isinstance(refused.value, RegistryUnreachableError)
    with pytest.raises(RegistryError, match="not a model URI"):
        resolve_model(f"models:/{NAME}/{'9' * 5000}", project)


def test_a_stale_half_or_altered_cache_is_replaced_and_a_corrupt_download_leaves_nothing(
    project: Settings, exported_model: Path
) -> None:
    registered = register(exported_model, settings=project, alias="champion")
    uri = f"models:/{NAME}@champion"
    path = cache_path(project, NAME, 1)

    # A crash before the rename can only leave a hidden temporary folder; a folder from another
    # registry (same name and version, other run) must not be taken for this version.
    path.mkdir(parents=True)
    (path / ORIGIN).write_text(json.dumps({"run_id": "another-run", "source": "x"}))
    (path / "model.json").write_text("{}")
    (path / ONNX).write_bytes(b"not this model")
    assert resolve_model(uri, project) == path
    assert json.loads((path / ORIGIN).read_text())["run_id"] == registered.run_id
    assert (path / ONNX).read_bytes() == (exported_model / ONNX).read_bytes()

    # The cached model.onnx replaced under a complete cache entry (same origin): its sha256 is
    # checked on every use, so the version is downloaded again rather than scored with another.
    (path / ONNX).write_bytes((path / ONNX).read_bytes()[:-100] + b"\0" * 100)
    assert resolve_model(uri, project) == path
    assert (path / ONNX).read_bytes() == (exported_model / ONNX).read_bytes()

    # The artifact store's copy changes after registration: the download is refused by the
    # registered sha256, and nothing is left in the cache that looks like that version.
    download_uri = MlflowClient(project.tracking_uri).get_model_version_download_uri(NAME, "1")
    stored = Path(download_uri.removeprefix("file://")) / "artifacts" / ONNX  # the pyfunc's
    stored.write_bytes(stored.read_bytes()[:-100])
    (path / ORIGIN).unlink()
    with pytest.raises(RegistryError, match="does not match the sha256"):
        resolve_model(uri, project)
    assert not (path / ORIGIN).exists()
    assert _leftovers(path.parent) == []


def test_the_score_flow_takes_a_path_or_the_champion_by_default(
    prefect_api: None,
    project: Settings,
    exported_model: Path,
    digits_split: tuple[Path, Path],
    tmp_path: Path,
) -> None:
    from flows.score import score_flow

    val = digits_split[1]
    by_path = score_flow(model=str(exported_model), images=str(val), dest=str(tmp_path / "a.csv"))
    assert (by_path.model_dir, by_path.version) == (exported_model, None)

    register(exported_model, settings=project, alias="champion")
    state = score_flow(images=str(val), return_state=True)  # default: <registered name>@champion
    by_alias = state.result()
    assert by_alias.model == f"models:/{NAME}@champion"
    assert (by_alias.model_dir, by_alias.version) == (cache_path(project, NAME, 1), 1)
    assert by_alias.scored.parent == project.home_dir / "scores"
    assert by_alias.scored.name.startswith(f"{NAME}-v1-")
    pd.testing.assert_frame_equal(pd.read_csv(by_alias.scored), pd.read_csv(by_path.scored))

    # The run's own report: which version scored what, how many, where the table is.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        this_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        (report,) = [a for a in client.read_artifacts(flow_run_filter=this_run)
                     if a.key == "scoring-report"]  # fmt: skip
    table = pd.read_csv(by_alias.scored, dtype=str)
    rows = len(table)
    assert report.data.splitlines()[2] == "| scoring | this run |"  # a header, not an empty row
    assert f"`models:/{NAME}@champion` (version 1)" in report.data  # file store: no UI link
    assert f"| rows | {rows:,} |" in report.data and "| unreadable (a row" in report.data
    # The images are an ImageDirectory's: each has its class, so the report says how many were
    # right (issue 47: a labelled scoring showed no accuracy).
    right = int((table["category"] == table["Scored Labels"]).sum())
    assert f"| accuracy | {right / rows:.4f} ({right:,} of {rows:,} labelled images) |" in (
        report.data
    )
    assert f"| table | `{by_alias.scored}` |" in report.data


def test_a_version_logged_with_the_onnx_flavor_still_resolves(
    project: Settings, exported_model: Path
) -> None:
    # Versions registered before the pyfunc (MLflow's ONNX flavor, model.json beside it in the
    # run) stay scorable from a registry that holds both kinds.
    configure_mlflow(project)
    with mlflow.start_run() as run:
        logged = mlflow.onnx.log_model(
            onnx.load(str(exported_model / ONNX)),
            name="model",
            save_as_external_data=False,
            pip_requirements=mlflow.onnx.get_default_pip_requirements(),
        )
        mlflow.log_artifact(str(exported_model / "model.json"), artifact_path=DIRECTORY_ARTIFACTS)
    mlflow.register_model(logged.model_uri, NAME)

    cached = fetch_registered_model(f"models:/{NAME}/1", project)

    assert cached.run_id == run.info.run_id
    assert (cached.path / ONNX).read_bytes() == (exported_model / ONNX).read_bytes()
    assert (cached.path / "model.json").read_bytes() == (exported_model / "model.json").read_bytes()


def test_a_champion_moved_by_hand_without_a_webhook_is_recorded_when_next_resolved(
    project: Settings, exported_model: Path
) -> None:
    """Embedded mode has no MLflow server, so no webhook tells imageops of a move by hand."""
    register(exported_model, settings=project, alias="champion")
    register(exported_model, settings=project)
    configure_mlflow(project)
    client = MlflowClient()
    client.set_registered_model_alias(NAME, "champion", "2")  # as `mlflow ui` on SQLite would

    assert fetch_registered_model(f"models:/{NAME}@champion", project).version == 2

    tags = {v: client.get_model_version(NAME, str(v)).tags["champion.record"] for v in (1, 2)}
    assert tags[2].startswith("yes, since ")
    assert tags[2].endswith("(by hand in the MLflow registry; the time imageops first saw it)")
    assert tags[1].startswith("no: was @champion from ") and tags[1].endswith("; then v2")
