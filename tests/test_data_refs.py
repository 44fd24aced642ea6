"""Data sets by version, from any machine: ``NAME@VERSION`` references and their resolver.

A "second machine" is a second project root and IMAGEOPS_HOME that share only the DVC remote
folder with the first (no data/, no DVC repository of the first's). Real DVC, real Prefect API,
real torchrun and MLflow; the digits as 16 px PNGs.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from mlflow import MlflowClient
from projects import use_project
from training_runs import FAST, PRE
from typer.testing import CliRunner

from tasks.data.imagedir import read_manifest
from tasks.data.versioning import version
from tasks.shared.errors import DataUnavailableError, InvalidParameterError
from tasks.shared.settings import Settings

pytest_plugins = ["model_fixtures"]
ONE_EPOCH = {**FAST, "epochs": 1, "nproc_per_node": 1, "precision": "fp32"}


def machine(root: Path, remote: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """A machine of the team: its own checkout and home; the DVC remote is the team's."""
    monkeypatch.setenv("IMAGEOPS_DVC_REMOTE_URL", str(remote))
    return use_project(root, monkeypatch)


@pytest.fixture
def first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digits_split: tuple[Path, Path]
) -> tuple[Settings, dict[str, str]]:
    """The machine that prepared the digits: train and val versioned (val tagged v1)."""
    settings = machine(tmp_path / "a", tmp_path / "remote", monkeypatch)
    md5 = {}
    for part, folder in zip(("train", "val"), digits_split, strict=True):
        shutil.copytree(folder, settings.data_path / "digits" / part)
        md5[part] = version(settings.data_path / "digits" / part, settings, tags=["v1"])
    return settings, md5


@pytest.mark.slow
def test_a_machine_without_the_data_trains_and_scores_from_versions_under_prefect(
    prefect_api: None,
    first: tuple[Settings, dict[str, str]],
    exported_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flows.score import score_flow
    from flows.train import train_model_flow
    from tasks.data.data_refs import resolve_data

    _, md5 = first
    second = machine(tmp_path / "b", tmp_path / "remote", monkeypatch)
    assert not second.data_path.exists()
    val_hex = md5["val"].removesuffix(".dir")  # `.dir` is optional in a reference
    trained = train_model_flow(
        train_data="digits/train@latest", val_data=f"digits/val@{val_hex}", params=ONE_EPOCH,
        transform=PRE, steps={"version_data": True, "register_model": False},
    )  # fmt: skip
    assert (trained.model_dir / "model.safetensors").is_file()
    assert trained.data_version == md5  # recorded, not versioned again
    assert trained.data_refs == {part: f"digits/{part}@{md5[part]}" for part in md5}
    run = MlflowClient(second.tracking_uri, second.registry_uri).get_run(trained.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["imageops.data_version.train"] == md5["train"]
    # The deployment's default path, which this machine lacks: the data set's latest version.
    scored = score_flow(model=str(exported_model), images="data/digits/val")
    val = resolve_data(trained.data_refs["val"], "validation data").path
    assert len(scored.scored.read_text().splitlines()) == 1 + len(read_manifest(val).images)
    assert not second.data_path.exists()


def test_a_registered_version_names_its_data_by_reference(
    project: Settings, exported_model: Path
) -> None:
    """The registry keeps name@md5 beside the md5 tags: retrain on the same data anywhere."""
    from tasks.registry.register import register

    md5 = {"train": "a" * 32 + ".dir", "val": "b" * 32 + ".dir"}
    refs = {part: f"digits/{part}@{value}" for part, value in md5.items()}
    done = register(exported_model, settings=project, data_version=md5, data_refs=refs)
    tags = (
        MlflowClient(project.tracking_uri, project.registry_uri)
        .get_model_version(done.name, str(done.version))
        .tags
    )
    assert tags["data_ref.train"] == refs["train"] and tags["data_ref.val"] == refs["val"]
    assert tags["data_md5.train"] == md5["train"]  # the existing tags, as they were


def test_a_missing_path_under_data_is_its_latest_version_said_in_one_line(
    first: tuple[Settings, dict[str, str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tasks.data.data_refs import resolve_data

    _, md5 = first
    machine(tmp_path / "b", tmp_path / "remote", monkeypatch)
    with caplog.at_level(logging.INFO, logger="tasks.data.data_refs"):
        found = resolve_data("data/digits/train", "training data")
    assert (found.name, found.md5, found.ref) == ("digits/train", md5["train"],
                                                  f"digits/train@{md5['train']}")  # fmt: skip
    assert read_manifest(found.path).images
    said = [r.getMessage() for r in caplog.records if r.name == "tasks.data.data_refs"]
    assert len(said) == 1 and "is not on this machine" in said[0]
    assert f"digits/train@latest = {md5['train']}" in said[0]
    # A tag, an md5 written from the project root, and a path that exists: as they say.
    assert resolve_data("digits/val@v1", "validation data").md5 == md5["val"]
    assert resolve_data(f"data/digits/val@{md5['val']}", "validation data").name == "digits/val"
    assert resolve_data(found.path, "training data").md5 is None


def test_a_missing_version_or_tag_is_one_error_naming_it_and_the_remote(
    first: tuple[Settings, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.data.data_refs import resolve_data

    machine(tmp_path / "b", tmp_path / "remote", monkeypatch)
    remote = str(tmp_path / "remote")
    missing = "0123456789abcdef0123456789abcdef"
    with pytest.raises(DataUnavailableError) as unknown_version:
        resolve_data(f"digits/train@{missing}", "training data")
    with pytest.raises(DataUnavailableError) as unknown_tag:
        resolve_data("digits/train@v2", "training data")
    with pytest.raises(InvalidParameterError) as not_versioned:
        resolve_data("data/digits/test", "training data")
    with pytest.raises(InvalidParameterError, match="not a usable data version tag"):
        resolve_data("digits/train@no*tag", "training data")
    for err, named in ((unknown_version, missing), (unknown_tag, "digits/train@v2"),
                       (not_versioned, "data/digits/test")):  # fmt: skip
        assert named in str(err.value) and remote in str(err.value)
    assert not (tmp_path / "b" / ".imageops" / "data-versions" / missing).exists()


def test_imageops_version_prints_the_reference_and_records_its_tags_in_the_remote(
    project: Settings, digits_split: tuple[Path, Path]
) -> None:
    from app.cli import app
    from tasks.data.data_refs import latest_version, resolve_data

    shutil.copytree(digits_split[0], project.data_path / "digits" / "train")
    done = CliRunner().invoke(app, ["version", "data/digits/train", "--tag", "v1"])
    assert done.exit_code == 0, done.output
    ref = done.output.splitlines()[0]
    name, _, md5 = ref.partition("@")
    assert name == "digits/train" and md5.endswith(".dir") and len(md5) == 36
    assert latest_version("data/digits/train") == md5
    assert resolve_data("digits/train@v1", "training data").md5 == md5
    refused = CliRunner().invoke(app, ["version", "data/digits/train", "--tag", "a/b"])
    assert isinstance(refused.exception, InvalidParameterError)


def test_the_forms_take_references() -> None:
    """`prefect deployment run -p train_data=digits/train@latest`: the schema refuses nothing."""
    from prefect.utilities.schema_tools import validate

    from flows.config import PipelineConfig
    from flows.score import score_flow
    from flows.train import train_model_flow
    from flows.tune import tune_flow
    from tasks.shared.forms import form_schema

    for flow, parameter in ((train_model_flow, "train_data"), (train_model_flow, "val_data"),
                            (tune_flow, "train_data"), (score_flow, "images")):  # fmt: skip
        schema = form_schema(flow).model_dump_for_openapi()
        assert "NAME@VERSION" in schema["properties"][parameter]["description"]
        validate({parameter: "digits/train@latest"}, schema, raise_on_error=True)
    assert (
        "NAME@VERSION" in PipelineConfig.model_json_schema()["properties"]["source"]["description"]
    )


def test_the_same_sample_prepared_on_two_machines_is_one_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each machine writes, converts, splits and versions the sample in its own checkout."""
    from tasks.data.convert import convert
    from tasks.data.sample import write_digits
    from tasks.data.split import split

    md5 = []
    for name in ("a", "b"):
        settings = machine(tmp_path / name, tmp_path / f"remote-{name}", monkeypatch)
        data = settings.data_path
        write_digits(data / "raw" / "digits", size=8, classes=[0, 1], per_class=4)
        convert(data / "raw" / "digits", data / "digits" / "images")
        split(data / "digits" / "images", data / "digits" / "train", data / "digits" / "val")
        md5.append([version(data / "digits" / p, settings) for p in ("images", "train", "val")])
    assert md5[0] == md5[1]


def test_a_pipeline_versions_its_source_so_a_machine_without_it_starts_from_its_latest(
    prefect_api: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digits_raw: Path
) -> None:
    from flows.config import PipelineConfig
    from flows.pipeline import versioned_data
    from tasks.data.convert import convert
    from tasks.data.split import split

    settings = machine(tmp_path / "a", tmp_path / "remote", monkeypatch)
    data = settings.data_path / "digits"
    shutil.copytree(digits_raw, settings.data_path / "raw" / "digits")
    source, _ = PipelineConfig().check_sources(settings)  # the nightly deployment's default
    convert(source.path, data / "images")
    split(data / "images", data / "train", data / "val", fraction=0.8)
    versions = versioned_data(source, data, settings)
    assert list(versions) == ["source", "images", "train", "val"]
    assert versions["source"].ref.startswith("raw/digits@")  # type: ignore[union-attr]

    second = machine(tmp_path / "b", tmp_path / "remote", monkeypatch)
    fetched, folder = PipelineConfig().check_sources(second)
    assert (fetched.md5, folder) == (versions["source"].md5, second.data_path / "digits")
    named = PipelineConfig(source="raw/digits@latest")
    assert named.dataset_name == "digits"
    assert named.check_sources(second)[0].path == fetched.path
