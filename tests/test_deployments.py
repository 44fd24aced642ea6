"""deployments/prefect.yaml names flows that exist: a typo there fails here, not on a worker."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml
from prefect import Flow

ROOT = Path(__file__).resolve().parents[1]
SPEC = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())


@pytest.mark.parametrize("deployment", SPEC["deployments"], ids=lambda d: d["name"])
def test_every_entrypoint_is_a_flow_that_takes_the_parameters(deployment: dict) -> None:
    # Module paths: a worker imports the installed package, wherever its working folder is.
    module, _, name = deployment["entrypoint"].rpartition(".")
    flow = getattr(importlib.import_module(module), name)
    assert isinstance(flow, Flow)
    accepted = set(flow.parameters.properties)
    given = set(deployment.get("parameters") or {})
    for trigger in deployment.get("triggers", []):
        given |= set(trigger.get("parameters") or {})
    assert given <= accepted, f"{deployment['name']}: unknown parameters {given - accepted}"


def test_the_promote_and_score_deployments_are_there() -> None:
    names = {d["name"] for d in SPEC["deployments"]}
    assert {"pipeline", "train", "tune", "tune-trial", "promote", "score"} <= names
