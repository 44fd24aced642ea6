"""The folders are the layers: app → flows → tasks → models, and steps stay plain functions.

A newcomer reads the layout from the folders (docs/layout.md); these checks keep it true.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("app", "flows", "tasks", "models")  # each may import only the ones after it
STAGES = ("shared", "cluster", "data", "train", "registry", "inference", "tune")


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (imports inside functions count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("layer", LAYERS)
def test_imports_point_down_the_layers(layer: str) -> None:
    above = set(LAYERS[: LAYERS.index(layer)])
    wrong = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _files(layer)
        for name in _imports(path)
        if name.split(".")[0] in above
    ]
    assert not wrong, wrong


def test_flows_holds_flows_only() -> None:
    """Every module in flows/ defines a Prefect flow (``@checked_flow``: a flow that refuses bad
    parameters in words), or is the form those flows take."""
    not_flows = []
    for path in _files("flows"):
        source = path.read_text()
        flow = "@checked_flow(" in source
        if path.name != "__init__.py" and not flow and "BaseModel" not in source:
            not_flows.append(path.name)
    assert not not_flows, not_flows


def test_tasks_are_grouped_by_stage() -> None:
    loose = [p.name for p in (ROOT / "tasks").glob("*.py") if p.name != "__init__.py"]
    folders = {p.name for p in (ROOT / "tasks").iterdir() if (p / "__init__.py").exists()}
    assert not loose, f"modules outside a stage folder: {loose}"
    assert folders == set(STAGES), folders


def test_the_cluster_layer_sits_below_the_jobs_that_use_it() -> None:
    """One cluster layer: tasks/cluster imports only tasks.shared (and models); training and
    scoring import it, never each other's cluster code (issue 45, must-hold 8)."""
    wrong = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _files("tasks/cluster")
        for name in _imports(path)
        if name.startswith("tasks.") and not name.startswith(("tasks.shared", "tasks.cluster"))
    ]
    across = [
        f"{path.relative_to(ROOT)} imports {name}"
        for stage, other in (("inference", "tasks.train"), ("train", "tasks.inference"))
        for path in _files(f"tasks/{stage}")
        for name in _imports(path)
        if name.startswith(other)
    ]
    # Joining the cluster and ending a job's actors happen in the layer only.
    elsewhere = [
        f"{path.relative_to(ROOT)}: {call}"
        for layer in LAYERS
        for path in _files(layer)
        if not path.relative_to(ROOT).as_posix().startswith("tasks/cluster/")
        for call in ("ray.init(", "ray.kill(", "remove_placement_group(")
        if call in path.read_text()
    ]
    assert not wrong and not across and not elsewhere, wrong + across + elsewhere


SUBMITTING = {"flow", "run_deployment", "wait", "as_completed", "ThreadPoolTaskRunner"}


def test_steps_submit_nothing_to_prefect() -> None:
    """Submission (flows, task runners, futures, deployments) lives in flows/; steps stay plain."""
    submitting = []
    for path in _files("tasks"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prefect"):
                names = {alias.name for alias in node.names}
                module = node.module or ""
                if names & SUBMITTING or module.startswith(
                    ("prefect.task_runners", "prefect.futures", "prefect.deployments")
                ):
                    submitting.append(f"{path.relative_to(ROOT)}: from {module} import {names}")
    assert not submitting, submitting


def test_the_layout_page_names_every_module() -> None:
    """docs/layout.md maps every module; a new one is added there with its one line."""
    page = (ROOT / "docs" / "layout.md").read_text()
    missing = [
        path.relative_to(ROOT).as_posix()
        for layer in LAYERS
        for path in _files(layer)
        if path.name != "__init__.py" and f"`{path.relative_to(ROOT).as_posix()}`" not in page
    ]
    assert not missing, f"add to docs/layout.md: {missing}"


MAX_PARAMETERS = 7  # more means the arguments belong together in one model (TrainRequest, ...)
MAX_MODULE_LINES = 500  # a longer module holds more than one job: split it by job


def test_no_function_takes_more_than_seven_parameters() -> None:
    """A request travels whole (one pydantic model), so no signature re-lists its fields."""
    too_many = []
    for layer in LAYERS:
        for path in _files(layer):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    args = node.args
                    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
                    count = len([name for name in names if name not in ("self", "cls")])
                    if count > MAX_PARAMETERS:
                        too_many.append(f"{path.relative_to(ROOT)}:{node.name} ({count})")
    assert not too_many, f"group these parameters into a model: {too_many}"


def test_no_module_is_over_five_hundred_lines() -> None:
    too_long = [
        f"{path.relative_to(ROOT)} ({lines})"
        for layer in LAYERS
        for path in _files(layer)
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not too_long, f"split these modules by job: {too_long}"


def test_ruff_checks_every_source_file_of_the_checkout() -> None:
    """A bare exclude pattern ("data") once kept all of tasks/data/ out of `ruff check`."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is not installed: it is in the lock (make install)"
    listed = subprocess.run(
        [ruff, "check", "--show-files", "."], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    checked = {Path(line.strip()).resolve() for line in listed.splitlines() if line.strip()}
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout: no list of the project's source files")
    skipped = [name for name in tracked if (ROOT / name).resolve() not in checked]
    assert skipped == [], f"ruff check leaves out: {skipped[:10]}"
