"""`imageops serve` brings the stack up for real, and people use it as they would from the UI.

One stack per module (a Prefect server with its scheduler, a worker on the `local` pool, an
MLflow server, the promotion receiver), started as a person starts it: the `imageops serve`
command in its own process. The tests then use it with Prefect's own clients, as people do: the
`prefect` command (list, run a deployment with part of a parameter, read a run's logs) and its
Python client (what the UI's forms and Run button send). The last test presses Ctrl-C and checks
nothing is left running.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC
from datetime import time as clock
from functools import partial
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import psutil
import pytest
from file_modes import open_to_others
from prefect_runs import prefect_api_at, prefect_rows
from server_processes import LONG_WAIT, PROMPT_WORKER

from app.work_pools import base_job_template
from tasks.shared import servers
from tasks.shared.servers import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MODEL = "imageops-classifier"
PREFECT = Path(sys.executable).with_name("prefect")  # the `prefect` command of this environment
FULL_NAME = re.compile(r"imageops-[a-z-]+/[a-z-]+")  # flow/deployment, as `prefect` prints it


@dataclass
class Served:
    process: subprocess.Popen
    log: Path
    root: Path
    api: str
    mlflow: str
    env: dict[str, str]  # `imageops serve` as it was started: its environment and command
    command: list[str]
    before: str  # the id of a flow run made on `imageops run`'s temporary API before the stack

    @property
    def auth(self) -> str:
        """The Prefect API's auth string, as `imageops serve` keeps it (what it prints to use)."""
        return (self.root / ".imageops" / "stack" / "prefect-auth-string").read_text().strip()

    def report(self) -> str:
        logs = [self.log, *sorted((self.root / ".imageops" / "stack" / "logs").glob("*.log"))]
        return "\n".join(
            f"----- {p.name} -----\n{p.read_text(errors='replace')[-3000:]}"
            for p in logs
            if p.is_file()
        )

    def wait(self, what: str, ready: Callable[[], Any], timeout_s: float = 240.0) -> Any:
        def attempt() -> Any:
            if self.process.poll() is not None:
                pytest.fail(f"imageops serve exited while waiting for {what}\n{self.report()}")
            with contextlib.suppress(httpx.HTTPError):
                return ready()

        result = servers.wait_until(attempt, timeout_s, **LONG_WAIT)
        if not result:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{self.report()}")
        return result

    @contextmanager
    def client(self) -> Iterator[Any]:
        """Prefect's own Python client, pointed at this stack."""
        from prefect.client.orchestration import get_client

        with (
            prefect_api_at(self.api, self.auth),
            get_client(sync_client=True) as client,
        ):
            yield client

    def prefect(self, *args: str) -> str:
        """Run the `prefect` command against this stack, as a person at a shell does; its output."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "IMAGEOPS_"))}
        env |= {
            "PREFECT_API_URL": self.api,
            "PREFECT_API_AUTH_STRING": self.auth,
            "PREFECT_HOME": str(self.root / ".prefect-cli"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "COLUMNS": "200",  # wide enough that tables print whole names
        }
        done = subprocess.run(
            [str(PREFECT), *args], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def deployment(self, full_name: str) -> Any:
        with self.client() as client:
            return client.read_deployment_by_name(full_name)

    def artifact(self, flow_run_id: UUID, key: str) -> Any:
        """The artifact ``key`` that flow run ``flow_run_id`` published (there is one)."""
        from prefect.client.schemas.filters import (
            ArtifactFilter,
            ArtifactFilterFlowRunId,
            ArtifactFilterKey,
        )

        query = ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
            key=ArtifactFilterKey(any_=[key]),
        )
        with self.client() as client:
            (found,) = client.read_artifacts(artifact_filter=query)
        return found

    def flow_runs(self, deployment_id: UUID, states: list[str] | None = None) -> list[Any]:
        from prefect.client.schemas.filters import (
            FlowRunFilter,
            FlowRunFilterDeploymentId,
            FlowRunFilterState,
            FlowRunFilterStateType,
        )
        from prefect.client.schemas.sorting import FlowRunSort

        query = FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]))
        if states:
            query.state = FlowRunFilterState(type=FlowRunFilterStateType(any_=states))
        with self.client() as client:
            return client.read_flow_runs(
                flow_run_filter=query, sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=100
            )

    def finished(self, flow_run_ids: list[UUID], ok: bool = True) -> Callable[[], list | None]:
        """A ``wait`` condition: the runs, once all are final (a failure fails the test if ok)."""

        def done() -> list | None:
            with self.client() as client:
                runs = [client.read_flow_run(i) for i in flow_run_ids]
            for run in runs:
                if ok and run.state_type.value in {"FAILED", "CRASHED", "CANCELLED"}:
                    pytest.fail(f"run {run.name} ended {run.state_type.value}\n{self.report()}")
            return runs if all(r.state and r.state.is_final() for r in runs) else None

        return done


def deployments_of_the_file() -> set[str]:
    """Every deployment of deployments/prefect.yaml by full name (flow/deployment)."""
    from app.deployments import full_names

    return set(full_names())


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, digits_split: tuple[Path, Path]
) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("served-project")
    ports = {"prefect": free_port(), "mlflow": free_port(), "receiver": free_port()}
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_", "MLFLOW_", "IMAGEOPS_"))
    }
    env |= {
        "PYTHONPATH": str(ROOT),
        "IMAGEOPS_PROJECT_ROOT": str(root),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        # Prefect's own settings pass through the stack: a scheduler that looks every second
        # (not every minute), and a prompt worker.
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1",
    } | PROMPT_WORKER
    before = _run_before_the_stack(root, env)
    log = root / "serve.log"
    command = [sys.executable, "-m", "app.cli", "serve",
               "--prefect-port", str(ports["prefect"]), "--mlflow-port", str(ports["mlflow"]),
               "--receiver-port", str(ports["receiver"])]  # fmt: skip
    process = servers.start(command, log, env, cwd=root)
    served = Served(
        process,
        log,
        root,
        api=f"http://127.0.0.1:{ports['prefect']}/api",
        mlflow=f"http://127.0.0.1:{ports['mlflow']}",
        env=env,
        command=command,
        before=before,
    )
    try:
        served.wait("`imageops serve` to say ready", lambda: "ready" in log.read_text())
        yield served
    finally:
        if process.poll() is None:  # the last test stops it with Ctrl-C; this is for a failure
            # Its services first (listed while they are still its children), then itself.
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()


# What `imageops run` made before any stack was up (on its temporary API, app/cli/root.py): the
# whole pipeline on 60 digits at 8 px, in an MLflow experiment and registered model of its own, so
# the stack's tests of "imageops" and "imageops-classifier" count only their own runs.
BEFORE_THE_STACK = {
    "IMAGEOPS_MLFLOW_EXPERIMENT": "before-the-stack",
    "IMAGEOPS_REGISTERED_MODEL_NAME": "before-the-stack",
}


def _run_before_the_stack(root: Path, env: dict[str, str]) -> str:
    """`imageops run` in the project before `imageops serve`; the id of its flow run."""
    import yaml

    from tasks.data.sample import write_digits

    source = write_digits(root / "before-the-stack", size=8, classes=[0, 1, 2], per_class=20)
    params = root / "before-the-stack.yaml"
    params.write_text(yaml.safe_dump({
        "transform": {"resize_size": 8, "center_crop_size": 8, "random_horizontal_flip": False},
        "split": {"fraction": 0.8}, "train": {"batch_size": 16}, "quantize": False,
    }))  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "run", str(source), "--config", str(params),
         "--epochs", "1", "--nproc-per-node", "1"],
        env=env | BEFORE_THE_STACK, cwd=root, capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    ((flow_run,),) = prefect_rows(
        root / ".imageops" / "prefect" / "prefect.db",
        "SELECT id FROM flow_run WHERE name LIKE 'pipeline-%' AND state_type = 'COMPLETED'",
    )
    return str(UUID(flow_run))


def test_runs_made_before_the_stack_show_in_its_prefect_ui(served: Served) -> None:
    """One Prefect history per project (issue 47): the pipeline `imageops run` ran on its temporary
    API before `imageops serve` came up is in the stack's Prefect with its artifacts, as the
    `prefect` command shows them; in the stack's UI its summary says what happened to the model
    in words (issue 47, point 7)."""
    assert "imageops-pipeline" in served.prefect("flow", "ls")
    with served.client() as client:
        run = client.read_flow_run(UUID(served.before))
        assert run.state is not None and run.state.is_completed()
    assert "pipeline-summary" in served.prefect("artifact", "ls")
    if CHROMIUM is not None:  # and in the stack's UI: the run's page, its summary one tab away
        ui = served.api.removesuffix("/api")
        with browser_page(served.auth) as page:
            page.goto(f"{ui}/runs/flow-run/{served.before}")
            page.get_by_text(run.name).first.wait_for(timeout=60_000)
            page.locator("li.p-tab", has_text="Artifacts").click()  # the run page's tabs
            page.get_by_text("pipeline-summary", exact=True).first.click()
            page.get_by_text("Promotion:").first.wait_for(timeout=60_000)
            text = page.inner_text("body")
            assert "before-the-stack v1 is now @champion" in text, text[-3000:]
            assert re.search(r"accuracy\s+\d\.\d{4}", text), text[-3000:]
            shoot(page, "prefect-pipeline-summary")


def test_serve_prints_both_uis_and_binds_to_localhost(served: Served) -> None:
    printed = served.log.read_text()
    assert f"Prefect UI  {served.api.removesuffix('/api')}" in printed
    assert f"MLflow UI   {served.mlflow}" in printed
    listening = {
        c.laddr.ip
        for p in psutil.Process(served.process.pid).children(recursive=True)
        for c in p.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }
    assert listening and listening <= {"127.0.0.1"}, listening


def test_what_serve_prints_works_with_the_prefect_and_mlflow_commands(served: Served) -> None:
    """A person copies the printed export lines into another shell and runs Prefect's and
    MLflow's own commands: they must reach this stack, not start servers of their own."""
    exports = [line.strip() for line in served.log.read_text().splitlines()
               if line.strip().startswith("export ")]  # fmt: skip
    assert any("PREFECT_API_URL=" in e and "MLFLOW_TRACKING_URI=" in e for e in exports)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "MLFLOW_", "IMAGEOPS_"))}  # fmt: skip
    env |= {"PREFECT_HOME": str(served.root / ".prefect-shell"), "COLUMNS": "200"}
    bin_dir = Path(sys.executable).parent
    script = "\n".join([*exports, f"{bin_dir}/prefect deployment ls",
                         f"{bin_dir}/mlflow experiments search"])  # fmt: skip
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert set(FULL_NAME.findall(done.stdout)) == deployments_of_the_file(), done.stdout
    assert "Default" in done.stdout  # MLflow's experiments, from this stack's server


def test_the_api_takes_no_request_without_the_auth_string(served: Served) -> None:
    """Issue 43: any local user PATCHed the pool's template with a command, unauthenticated (204).

    Now every request but the health checks needs the auth string, which `imageops serve` keeps
    owner-only (and the worker, the receiver and the registration use)."""
    kept = served.root / ".imageops" / "stack" / "prefect-auth-string"
    assert kept.stat().st_mode & 0o777 == 0o600
    hostile = base_job_template("local")
    hostile["job_configuration"]["command"] = "id"
    attempts = [
        ("GET", "/work_pools/local", None),
        ("PATCH", "/work_pools/local", {"base_job_template": hostile}),
        ("POST", "/deployments/", {"name": "x", "flow_id": str(UUID(int=0))}),
        ("POST", "/flow_runs/filter", {}),
    ]
    with httpx.Client(base_url=served.api, timeout=30) as api:
        for method, path, body in attempts:
            for auth in (None, ("imageops", "wrong")):
                answer = api.request(method, path, json=body, auth=auth)
                assert answer.status_code == 401, (method, path, auth, answer.status_code)
        assert api.get("/health").status_code == 200
        user, _, password = served.auth.partition(":")
        pool = api.get("/work_pools/local", auth=(user, password)).raise_for_status().json()
    assert pool["base_job_template"] == base_job_template("local")  # the PATCH changed nothing


def test_the_worker_runs_nothing_the_project_did_not_register(served: Served) -> None:
    """Issue 43's routes, taken with the auth string (a credential holder may still call the
    API): a command in the pool's template, a `run_shell_script` pull step in a registered
    deployment, a new deployment whose entrypoint is a file of the caller's. The worker refuses
    each run before anything of it starts: Crashed, saying what differs; no marker is written."""
    from prefect.client.schemas.actions import DeploymentUpdate, WorkPoolUpdate

    marker = served.root / "pwned"
    script = served.root / "hostile_flow.py"
    script.write_text(
        f"from pathlib import Path\nfrom prefect import flow\nPath({str(marker)!r} + '.entry')"
        ".touch()\n\n@flow\ndef hostile() -> None:\n    pass\n"
    )
    hostile_template = base_job_template("local")
    hostile_template["job_configuration"]["command"] = f"touch {marker}.template"
    shell = {"prefect.deployments.steps.run_shell_script": {"script": f"touch {marker}.pull"}}
    promote = served.deployment("imageops-promote/promote")
    created = None
    with served.client() as client:  # Prefect's client: it retries a busy server's 503
        try:
            client.update_work_pool("local", WorkPoolUpdate(base_job_template=hostile_template))
            client.update_deployment(promote.id, DeploymentUpdate(pull_steps=[shell]))
            created = client.create_deployment(
                flow_id=promote.flow_id, name="hostile-entry", entrypoint=f"{script}:hostile",
                pull_steps=promote.pull_steps, work_pool_name="local",
            )  # fmt: skip
            runs = [client.create_flow_run_from_deployment(d).id for d in (promote.id, created)]
            ended = served.wait(
                "the worker to take the runs", served.finished(runs, ok=False), timeout_s=120
            )
        finally:
            client.update_work_pool(
                "local", WorkPoolUpdate(base_job_template=base_job_template("local"))
            )
            client.update_deployment(promote.id, DeploymentUpdate(pull_steps=promote.pull_steps))
            if created is not None:
                client.delete_deployment(created)
    said = {run.id: run.state.message for run in ended}
    for run in ended:
        assert run.state_type.value == "CRASHED", (run.name, run.state_type, run.state.message)
        assert "refused" in said[run.id] and "job_configuration.command added" in said[run.id]
    assert "its pull steps are" in said[runs[0]] and "run_shell_script" in said[runs[0]]
    assert "hostile_flow.py:hostile" in said[runs[1]], said[runs[1]]
    assert not list(served.root.glob("pwned*")), "a caller's code ran on the worker"


def test_every_deployment_is_registered_with_a_typed_form(served: Served) -> None:
    with served.client() as client:
        flows = {f.id: f.name for f in client.read_flows()}
        registered = {f"{flows[d.flow_id]}/{d.name}" for d in client.read_deployments()}
        queues = {q.name: q.concurrency_limit for q in client.read_work_queues("local")}
    assert registered == deployments_of_the_file()

    train = served.deployment("imageops-train-model/train")
    assert train.enforce_parameter_schema is True
    schema = train.parameter_openapi_schema
    params = schema["definitions"]["TrainParams"]["properties"]
    assert params["epochs"]["title"] == "Epochs"
    assert params["epochs"]["exclusiveMinimum"] == 0
    # a number below 1, one input a person may leave empty for the recipe to fill, on the
    # form of the saved setting (a block type) the recipe options' picker picks
    recipe_options = params["recipe_options"]["allOf"][0]["$ref"].rsplit("/", 1)[-1]
    momentum = schema["definitions"][recipe_options]["properties"]["momentum"]
    assert (momentum["type"], momentum["exclusiveMaximum"]) == ("number", 1)
    assert params["learning_rate"]["description"].startswith("Initial learning rate")
    assert schema["properties"]["train_data"]["default"] == "data/digits/train"
    # The form keeps the demo's values (the ones a partial override keeps, flows.config) and
    # says what an empty picker means.
    assert schema["properties"]["params"]["default"]["nproc_per_node"] == 2
    assert "left empty: Processes per node 2" in schema["properties"]["params"]["description"]
    with served.client() as client:  # the pickers' block types, for the Blocks page and Add
        slugs = {t.slug for t in client.read_block_types()}
    assert {"imageops-recipe-options", "imageops-distribution"} <= slugs

    # Everything that trains shares the pool's `training` queue, which runs one at a time.
    for name in ("imageops-pipeline/pipeline", "imageops-train-model/train", "imageops-tune/tune"):
        assert served.deployment(name).work_queue_name == "training", name
    assert queues["training"] == 1


def test_the_schedules_create_upcoming_runs(served: Served) -> None:
    pipeline = served.deployment("imageops-pipeline/pipeline")
    score = served.deployment("imageops-score/score")
    nightly = served.wait(
        "the scheduler to create pipeline runs",
        lambda: served.flow_runs(pipeline.id, ["SCHEDULED"]),
        timeout_s=60,
    )
    for run in nightly:
        assert run.expected_start_time.astimezone(UTC).time() == clock(2), run.expected_start_time
    daily = served.wait(
        "the scheduler to create scoring runs",
        lambda: served.flow_runs(score.id, ["SCHEDULED"]),
        timeout_s=60,
    )
    for run in daily:
        assert run.expected_start_time.astimezone(UTC).time() == clock(6)
        assert run.parameters["model"] == f"models:/{MODEL}@champion"
    assert len({run.expected_start_time.date() for run in nightly}) == len(nightly)


def test_a_parameter_out_of_range_is_refused_by_the_server(served: Served) -> None:
    from prefect.exceptions import PrefectHTTPStatusError

    train = served.deployment("imageops-train-model/train")
    before = len(served.flow_runs(train.id))
    for bad in (
        {"params": {"epochs": 0}},
        {"params": {"momentum": 1.5}},  # given flat, as params.yaml and the README write it
        {"params": {"recipe_options": {"momentum": 1.5}}},  # a section given whole
        {"params": {"momentm": 0.5}},  # a misspelt field
        {"train_data": 3},
        {"steps": {"version_dat": False}},  # a misspelt switch
        {"params": {"cluster": ""}},  # an empty cluster address
    ):
        with served.client() as client, pytest.raises(PrefectHTTPStatusError) as refused:
            client.create_flow_run_from_deployment(train.id, parameters=bad)
        assert refused.value.response.status_code == 409, refused.value
        assert "Validation failed" in refused.value.response.text
    assert len(served.flow_runs(train.id)) == before  # nothing was created to fail later

    # The form's "Validate parameters" box unticked: the server takes the run, and the flow
    # refuses it before any step, in words naming the fields by their titles (issue 47, point 2).
    run_id = _submitted_unvalidated(served, train.id)

    def failed() -> Any:
        with served.client() as client:
            run = client.read_flow_run(run_id)
        return run if run.state is not None and run.state.is_final() else None

    run = served.wait("the unvalidated run to end", failed, timeout_s=180)
    assert run.state.is_failed()
    said = run.state.message or ""
    assert (
        "Training parameters > Epochs: 0 is not allowed; it must be an integer > 0 and <= 10000."
        in said
    ), said
    assert (
        "Training parameters > Batch size: 0 is not allowed; it must be an integer > 0 and "
        "<= 65536." in said
    ), said
    assert "params.epochs" not in said
    with served.client() as client:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        ran = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
        )
    assert ran == []  # no step ran
    if CHROMIUM is not None:  # what the person who ticked the box off reads on the run's page
        ui = served.api.removesuffix("/api")
        with browser_page(served.auth) as page:
            page.goto(f"{ui}/runs/flow-run/{run_id}")
            page.get_by_text("Epochs: 0 is not allowed", exact=False).first.wait_for(timeout=60_000)


UNVALIDATED = "unvalidated-epochs-0"


def _submitted_unvalidated(served: Served, deployment_id: UUID) -> UUID:
    """Epochs 0 and batch size 0 on the train form, "Validate parameters" unticked, Submit (in
    Chromium; without it, the API call the form then makes)."""
    if CHROMIUM is None:
        made = httpx.post(
            f"{served.api}/deployments/{deployment_id}/create_flow_run",
            json={"name": UNVALIDATED, "parameters": {"params": {"epochs": 0, "batch_size": 0}},
                  "enforce_parameter_schema": False},
            headers={"Authorization": f"Basic {_basic(served.auth)}"},
            timeout=30,
        )  # fmt: skip
        assert made.status_code == 201, made.text
        return UUID(made.json()["id"])
    ui = served.api.removesuffix("/api")
    with browser_page(served.auth) as page:
        page.goto(f"{ui}/deployments/deployment/{deployment_id}/run")
        page.get_by_text("Run Name", exact=True).wait_for(timeout=60_000)
        page.locator("input").first.fill(UNVALIDATED)
        form_input(page, "Epochs").fill("0")
        form_input(page, "Batch size").fill("0")
        page.get_by_role("checkbox", name="Validate parameters").uncheck()
        return submit(page, served, deployment_id, UNVALIDATED).id


def _basic(auth: str) -> str:
    import base64

    return base64.b64encode(auth.encode()).decode()


def test_runs_from_the_cli_and_the_form_train_one_at_a_time(
    served: Served, digits_split: tuple[Path, Path]
) -> None:
    """`prefect deployment run` with part of `params`, then Run on the form with all of them.

    The first run gives four of the training parameters, as a person types them: the others,
    processes per node included, stay the deployment's (2), not the class's (1). The second is
    typed into the run form in Chromium (:func:`submit_the_run_form`), with a run name of its own.
    """
    train_dir, val_dir = digits_split
    small = {"resize_size": 16, "center_crop_size": 16}
    typed = served.prefect(
        "deployment", "run", "imageops-train-model/train",
        "-p", f"train_data={train_dir}", "-p", f"val_data={val_dir}",
        "-p", 'params={"epochs": 1, "batch_size": 32, "learning_rate": 0.01, "print_frequency": 1}',
        "-p", f"transform={json.dumps(small)}", "-p", 'steps={"version_data": false}',
    )  # fmt: skip
    (cli_run,) = re.findall(r"UUID: ([0-9a-f-]{36})", typed)
    form_run = submit_the_run_form(served, digits_split)  # right after it

    runs = served.wait(
        "both training runs to complete", served.finished([UUID(cli_run), form_run.id]), 420
    )
    first, second = sorted(runs, key=lambda r: r.start_time)
    assert first.end_time <= second.start_time, "two trainings ran at once on one pool"
    typed_run = next(r for r in runs if str(r.id) == cli_run)
    assert typed_run.name.startswith("train-resnet18")
    # The form's run kept the name typed into it (not renamed train-resnet18-...) and its values.
    (form_run,) = [r for r in runs if r.id == form_run.id]
    assert form_run.name == FORM_RUN_NAME
    assert form_run.parameters["params"]["epochs"] == 1
    assert form_run.parameters["steps"] == {"version_data": False, "register_model": False}
    # The pickers sent references to the saved settings, which the run loaded; `prefect block
    # ls` lists the settings, by their type.
    picked = form_run.parameters["params"]
    assert set(picked["recipe_options"]) == set(picked["distribution"]) == {"$ref"}
    listed = served.prefect("block", "ls")
    for block_type in ("imageops-recipe-options", "imageops-distribution"):
        assert block_type in listed, listed

    # Each run is in MLflow with the parameters it was given, and the deployment's for the rest.
    from mlflow.tracking import MlflowClient

    # Both URIs: an earlier test in this process may have left MLflow a global registry URI.
    client = MlflowClient(tracking_uri=served.mlflow, registry_uri=served.mlflow)
    experiment = client.get_experiment_by_name("imageops")

    def params_of(rate: str) -> dict[str, str]:
        query = f"params.learning_rate = '{rate}'"
        (found,) = client.search_runs([experiment.experiment_id], query)
        assert found.info.status == "FINISHED"
        return found.data.params

    typed_params, form_params = params_of("0.01"), params_of("0.03")
    for params in (typed_params, form_params):
        assert params["epochs"] == "1"
        # the demo's transform for what the override left out: no mirrored digits
        assert params["transform.random_horizontal_flip"] == "False"
    assert typed_params["input_size"] == "16"  # the transform typed on the command line
    assert form_params["input_size"] == "32"  # the deployment's (the demo's)
    assert typed_params["nproc_per_node"] == "2"  # the deployment's, not the class's 1
    assert typed_params["world_size"] == "2"
    assert float(typed_params["effective_learning_rate"]) == pytest.approx(0.02)
    assert form_params["world_size"] == "1"  # 1 node x 1 process, as the form said
    assert form_params["optimizer"] == "adamw"  # set back to None: the modern recipe's
    assert form_params["schedule"] == "step"  # chosen on the form
    (version,) = client.search_model_versions(f"name = '{MODEL}'")  # the form said: no register
    assert client.get_model_version_by_alias(MODEL, "challenger").version == version.version


def test_a_flow_run_whose_worker_died_is_cancelled_by_prefect_flow_run_cancel(
    served: Served, digits_split: tuple[Path, Path]
) -> None:
    """A training flow run whose worker was SIGKILLed (its process goes on, another worker would
    never touch it): a cancellation (`prefect flow-run cancel`) ends it Cancelled within 30 s,
    its MLflow run (tagged with the flow run) KILLED, and no training process of it is left."""
    from mlflow.tracking import MlflowClient
    from prefect.states import Cancelling, Pending

    from tasks.train.mlflow_run import FLOW_RUN_TAG

    train_dir, val_dir = digits_split
    with served.client() as client:  # Pending: the stack's worker leaves it to ours
        flow_run = client.create_flow_run_from_deployment(
            served.deployment("imageops-train-model/train").id,
            parameters={
                "train_data": str(train_dir), "val_data": str(val_dir),
                "params": {"epochs": 500, "batch_size": 32, "nproc_per_node": 1},
                "transform": {"resize_size": 16, "center_crop_size": 16},
                "steps": {"version_data": False, "register_model": False},
            },
            state=Pending(),
        )  # fmt: skip
    env = served.env | {
        "PREFECT_API_URL": served.api, "PREFECT_API_AUTH_STRING": served.auth,
        "IMAGEOPS_PREFECT_API_URL": served.api, "IMAGEOPS_MLFLOW_TRACKING_URI": served.mlflow,
        "PREFECT_HOME": str(served.root / ".prefect-orphan"),
        "PREFECT__FLOW_RUN_ID": str(flow_run.id),
        "PYTHONFAULTHANDLER": "1",  # SIGABRT writes every thread's stack to its log
    }  # fmt: skip
    # A stand-in for the worker: the parent of the flow run's process, SIGKILLed under it.
    log = served.root / ".imageops" / "stack" / "logs" / "orphan-flow-run.log"  # in its report
    worker = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); "
         "time.sleep(900)", sys.executable, "-m", "app.flow_run_entry"],
        env=env, cwd=served.root, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    mlflow = MlflowClient(tracking_uri=served.mlflow, registry_uri=served.mlflow)
    try:
        (entry,) = served.wait("the flow run's process", psutil.Process(worker.pid).children, 30)

        def training() -> Any:
            experiment = mlflow.get_experiment_by_name("imageops")
            query = f"tags.`{FLOW_RUN_TAG}` = '{flow_run.id}' and attributes.status = 'RUNNING'"
            return experiment and mlflow.search_runs([experiment.experiment_id], query)

        (run,) = served.wait("the flow run's MLflow run", training, 240)
        worker.kill()
        worker.wait()
        with served.client() as client:  # what `prefect flow-run cancel` sends
            client.set_flow_run_state(flow_run.id, Cancelling())
        cancelled = time.monotonic()

        def ended() -> Any:
            with contextlib.suppress(httpx.HTTPError), served.client() as client:
                state = client.read_flow_run(flow_run.id).state
                return state.is_final() and state

        state = servers.wait_until(ended, 60, **LONG_WAIT)
        if not state:  # what the flow run's process was doing: its log ends with its stacks
            with contextlib.suppress(psutil.Error):
                entry.send_signal(signal.SIGABRT)
                entry.wait(timeout=20)
            pytest.fail(
                f"flow run still not final 60 s after the cancel; the end of {log}:\n"
                f"{log.read_text(errors='replace')[-8000:]}\n{served.report()}"
            )
        assert state.type.value == "CANCELLED", state
        assert time.monotonic() - cancelled < 30
        entry.wait(timeout=30)  # gone (not our child any more: its exit code is not ours to read)
        assert mlflow.get_run(run.info.run_id).info.status == "KILLED"
        left = [
            p.info["cmdline"]
            for p in psutil.process_iter(["cmdline"])
            if run.info.run_id in " ".join(p.info["cmdline"] or [])
        ]
        assert not left, left
    finally:
        worker.kill()
        for process in psutil.process_iter(["environ"]):
            with contextlib.suppress(psutil.Error):
                if (process.info["environ"] or {}).get("PREFECT__FLOW_RUN_ID") == str(flow_run.id):
                    process.kill()


def test_the_stack_ends_the_mlflow_runs_its_ended_flow_runs_left_running(served: Served) -> None:
    """A flow run ended Crashed (its process SIGKILLed: the worker, or the automation the stack
    creates, says so) or Cancelled with its MLflow run still RUNNING: `imageops serve` ends that
    run FAILED or KILLED; a run whose flow run goes on, or is unknown, stays RUNNING."""
    from mlflow.tracking import MlflowClient
    from prefect.states import Cancelled, Crashed, Pending

    from app.lost_flow_runs import (
        CANCEL_AUTOMATION,
        ZOMBIE_AFTER_S,
        ZOMBIE_AUTOMATION,
        ensure_automations,
    )
    from app.stranded_runs import RECONCILE_EVERY_S
    from tasks.train.mlflow_run import FLOW_RUN_TAG

    mlflow = MlflowClient(tracking_uri=served.mlflow, registry_uri=served.mlflow)
    experiment = mlflow.create_experiment(f"stranded-{time.time_ns()}")
    runs = {}
    with served.client() as client:
        (zombie,) = client.read_automations_by_name(ZOMBIE_AUTOMATION)
        assert zombie.trigger.within.total_seconds() == ZOMBIE_AFTER_S
        (cancel,) = client.read_automations_by_name(CANCEL_AUTOMATION)
        ensure_automations(client)  # a restart keeps them (they remember the runs they watch)
        assert [a.id for a in client.read_automations_by_name(ZOMBIE_AUTOMATION)] == [zombie.id]
        assert [a.id for a in client.read_automations_by_name(CANCEL_AUTOMATION)] == [cancel.id]
        deployment = served.deployment("imageops-score/score")
        for end in ("crashed", "cancelled", "going-on"):
            flow_run = client.create_flow_run_from_deployment(deployment.id, state=Pending())
            if end == "crashed":
                client.set_flow_run_state(flow_run.id, Crashed(), force=True)
            elif end == "cancelled":
                client.set_flow_run_state(flow_run.id, Cancelled(), force=True)
            tags = {FLOW_RUN_TAG: str(flow_run.id)}
            runs[end] = mlflow.create_run(experiment, tags=tags).info.run_id
    runs["unknown"] = mlflow.create_run(
        experiment, tags={FLOW_RUN_TAG: str(UUID(int=7))}
    ).info.run_id
    started = time.monotonic()

    def status(end: str) -> str:
        return mlflow.get_run(runs[end]).info.status

    ended = lambda: "RUNNING" not in (status("cancelled"), status("crashed"))  # noqa: E731
    served.wait("the stranded runs to end", ended, 60)
    assert status("crashed") == "FAILED" and status("cancelled") == "KILLED"
    assert time.monotonic() - started < RECONCILE_EVERY_S + 15
    assert status("going-on") == "RUNNING" and status("unknown") == "RUNNING"
    crashed = mlflow.get_run(runs["crashed"])
    assert "ended CRASHED" in crashed.data.tags["imageops.ended_by"]
    assert f"MLflow run {runs['crashed']} ended FAILED" in served.log.read_text()


# --- in a real browser: Playwright driving Debian's Chromium (apt-get install chromium) --------

CHROMIUM = shutil.which("chromium")
# `make screenshots` sets it: the docs' pictures are what these tests saw.
SCREENSHOTS = os.environ.get("IMAGEOPS_SCREENSHOTS")


@contextmanager
def browser_page(prefect_auth: str | None = None) -> Iterator[Any]:
    """A page of Debian's Chromium, driven by Playwright (the browser is not downloaded), logged
    in to the Prefect UI with ``prefect_auth`` (where its login page keeps the auth string)."""
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed: `apt-get install chromium` (.ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1600})
            if prefect_auth:
                page.add_init_script(
                    f"localStorage.setItem('prefect-password', btoa({json.dumps(prefect_auth)}))"
                )
            yield page
        finally:
            browser.close()


def shoot(page: Any, name: str, *, full_page: bool = False) -> None:
    """Save what the page shows as ``<IMAGEOPS_SCREENSHOTS>/<name>.png`` (when set), whole."""
    if SCREENSHOTS:
        folder = Path(SCREENSHOTS)
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{name}.partial.png"
        page.screenshot(path=str(partial), full_page=full_page)
        partial.replace(folder / f"{name}.png")


FORM_RUN_NAME = "typed-in-the-browser"


def form_input(page: Any, title: str) -> Any:
    """The input right after the field titled ``title``: a text box, or a select's button."""
    label = page.get_by_text(f"{title} (Optional)", exact=True).first
    inputs = "self::input or self::textarea or contains(@class, 'p-select-button__control')"
    return label.locator(f"xpath=following::*[{inputs}][1]")


def choose(page: Any, title: str, option: str) -> None:
    """Pick ``option`` in the select titled ``title``, as a person does with the keyboard (the
    select opens on the arrow key; headless Chromium's click does not open it), and see the
    select show it: None (the recipe's) shows as empty."""
    from playwright.sync_api import expect

    label = page.get_by_text(f"{title} (Optional)", exact=True).first
    select = label.locator("xpath=following::*[contains(@class, 'p-select-button__control')][1]")
    select.focus()
    page.keyboard.press("ArrowDown")
    page.get_by_role("option", name=option, exact=True).click()
    expect(select).to_have_text("" if option == "None" else option)


def submit_the_run_form(served: Served, digits_split: tuple[Path, Path]) -> Any:
    """Run on the training deployment's form, as a person fills it in Chromium: a run name, the
    data, 1 epoch, learning rate 0.03, two saved settings made with the pickers' Add (recipe
    options with the step schedule, machines with 1 process), no DVC version, no registering.
    The flow run.

    Without Chromium the same values go through the API call the form makes, the settings saved
    from Python (the browser's part is then not shown; .ci/run installs Chromium).
    """
    train = served.deployment("imageops-train-model/train")
    train_dir, val_dir = digits_split
    if CHROMIUM is None:
        from flows.saved_settings import SAVED_SETTINGS

        with prefect_api_at(served.api, served.auth):
            recipe = SAVED_SETTINGS["imageops-recipe-options"](schedule="step").save("step")
            machines = SAVED_SETTINGS["imageops-distribution"](nproc_per_node=1).save("one")
        with served.client() as client:
            return client.create_flow_run_from_deployment(
                train.id,
                name=FORM_RUN_NAME,
                parameters={
                    "train_data": str(train_dir), "val_data": str(val_dir),
                    "params": {
                        "epochs": 1, "learning_rate": 0.03,
                        "recipe_options": {"$ref": {"block_document_id": str(recipe)}},
                        "distribution": {"$ref": {"block_document_id": str(machines)}},
                    },
                    "steps": {"version_data": False, "register_model": False},
                },
            )  # fmt: skip
    from playwright.sync_api import expect

    ui = served.api.removesuffix("/api")
    with browser_page(served.auth) as page:
        page.goto(f"{ui}/deployments/deployment/{train.id}/run")
        page.get_by_text("Run Name", exact=True).wait_for(timeout=60_000)
        page.locator("input").first.fill(FORM_RUN_NAME)

        field = partial(form_input, page)
        field("Training data").fill(str(train_dir))
        field("Validation data").fill(str(val_dir))
        field("Epochs").fill("1")
        field("Learning rate").fill("0.03")
        # Saved settings made on the form (each picker's Add), in them a choice made and taken
        # back (None: the recipe's) and one kept; a picker emptied and set again.
        with saved_setting(page, "Recipe options", "step-schedule"):
            choose(page, "Optimizer", "sgd")
            choose(page, "Optimizer", "None")
            choose(page, "Learning-rate schedule", "step")
        with saved_setting(page, "Machines and processes", "one-process"):
            field("Processes per node").fill("1")
        choose(page, "Machines and processes", "None")
        choose(page, "Machines and processes", "one-process")
        for toggle in ("Version data with DVC", "Register"):
            label = page.get_by_text(f"{toggle} (Optional)", exact=True).first
            switch = label.locator("xpath=following::*[@role='switch'][1]")
            switch.click()
            expect(switch).to_have_attribute("aria-checked", "false")  # the click took

        return submit(page, served, train.id, FORM_RUN_NAME)


@contextmanager
def saved_setting(page: Any, picker: str, name: str) -> Iterator[None]:
    """Make a saved setting with the Add button of the picker titled ``picker``: the block's form
    opens in a dialog, named ``name``; the caller fills it; Create saves it, and the picker then
    shows it."""
    from playwright.sync_api import expect

    label = page.get_by_text(f"{picker} (Optional)", exact=True).first
    label.locator("xpath=following::button[contains(., 'Add')][1]").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("Block Name", exact=True).wait_for(timeout=30_000)
    dialog.locator("input").first.fill(name)
    yield
    dialog.get_by_role("button", name="Create").click()
    expect(dialog).to_be_hidden(timeout=30_000)
    select = label.locator("xpath=following::*[contains(@class, 'p-select-button__control')][1]")
    expect(select).to_have_text(name)


def submit(page: Any, served: Served, deployment_id: UUID, name: str) -> Any:
    """Click the form's Submit, as a person does; the flow run it made (named ``name``).

    The run, not the page's navigation, is what Submit must make. Three times on a busy machine
    a click made none (the page stayed on the form, the server got no run); the last, in CI,
    while the stack's SQLite Prefect database answered "database is locked" to its own
    services. So each click waits for the form's POST .../create_flow_run and its answer (a
    request held by the database lock ends within its 60 s busy timeout), and a person's second
    click follows one that made no run. What the page asked and got is kept for the failure
    message.
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    def submitted() -> Any:
        return next((r for r in served.flow_runs(deployment_id) if r.name == name), None)

    seen: list[str] = []
    page.on("response", lambda r: seen.append(f"{r.request.method} {r.url} -> {r.status}"))
    page.on("requestfailed", lambda r: seen.append(f"{r.method} {r.url} failed: {r.failure}"))
    page.on("console", lambda m: seen.append(f"console {m.type}: {m.text}"))

    def creates(response: Any) -> bool:
        return response.request.method == "POST" and "/create_flow_run" in response.url

    for _ in range(2):
        try:
            with page.expect_response(creates, timeout=150_000) as answer:
                page.get_by_role("button", name="Submit").click()
            if answer.value.ok:
                run = servers.wait_until(submitted, 60, **LONG_WAIT)
                if run:
                    return run
        except PlaywrightTimeout:
            seen.append("no POST .../create_flow_run answered within 150 s of the click")
    body = page.inner_text("body")
    pytest.fail(
        f"Submit made no flow run; the page ({page.url}) asked:\n"
        + "\n".join(seen[-60:])
        + f"\n...and shows, at its end:\n{body[-3000:]}\n{served.report()}"
    )


# A screen of the run form: a 1,400 x 900 browser window. "Fits a few screens" (issue 47):
# every run form at most this many of them.
SCREEN = (1400, 900)
MOST_SCREENS = 5


def test_browser_the_forms_show_each_field_titled_described_and_one_input(served: Served) -> None:
    """Every run form fits a few screens; each field titled and described; no switch between
    types anywhere; the basics first, then one picker per section (a saved setting), whose Add
    opens the setting's own form, titled and described alike, where a choice set back to None
    (the recipe's) shows empty again."""
    ui = served.api.removesuffix("/api")
    heights = {}
    for name in sorted(deployments_of_the_file()):
        deployment = served.deployment(name)
        with browser_page(served.auth) as page:
            page.set_viewport_size(dict(zip(("width", "height"), SCREEN, strict=True)))
            page.goto(f"{ui}/deployments/deployment/{deployment.id}/run")
            page.get_by_text("Parameters", exact=True).wait_for(timeout=60_000)
            schema = deployment.parameter_openapi_schema
            first = next(iter(schema["properties"].values()))["title"]
            page.get_by_text(first, exact=False).first.wait_for(timeout=60_000)
            # The form scrolls inside the page: the tallest scrolling box is the form's length.
            heights[name] = page.evaluate(
                "() => Math.max(...[...document.querySelectorAll('*')].map(e => e.scrollHeight))"
            )
            text = page.inner_text("body")
            if name.endswith("/train"):
                page.set_viewport_size({"width": 1400, "height": 1600})
                shoot(page, "prefect-train-run-form")
                assert "Processes per node (Optional)" not in text  # in the saved setting only
                label = page.get_by_text("Recipe options (Optional)", exact=True).first
                label.locator("xpath=following::button[contains(., 'Add')][1]").click()
                dialog = page.get_by_role("dialog")
                dialog.get_by_text("Optimizer (Optional)", exact=True).wait_for(timeout=30_000)
                # the dialog fades in: the picture once that has ended (spinners go on)
                page.wait_for_function(
                    "() => document.getAnimations().every(a => a.playState !== 'running' "
                    "|| a.effect.getComputedTiming().iterations === Infinity)"
                )
                shoot(page, "prefect-saved-setting-form")
                said = dialog.inner_text()
                assert "Property is type" not in said and "null" not in said.split()
                assert "Label smoothing (Optional)" in said
                choose(page, "Optimizer", "adamw")
                choose(page, "Optimizer", "None")
                choose(page, "Decay norm layers and biases", "true")
                dialog.get_by_role("button", name="Close").click()
        assert "Property is type" not in text, name
        for key, prop in schema["properties"].items():
            optional = "" if key in schema.get("required", ()) else " (Optional)"
            assert f"{prop['title']}{optional}" in text, f"{name}: {key}'s title"
            assert prop["description"] in text, f"{name}: {key}'s description"
        if name.endswith(("/train", "/pipeline")):
            for titles in (
                ("Epochs", "Learning rate", "Recipe options", "Machines and processes"),
                ("Image transformation", "Crop size", "Random changes in training",
                 "Normalisation"),
            ):  # fmt: skip
                shown = [text.index(f"{title} (Optional)") for title in titles]
                assert shown == sorted(shown), f"{name}: the basics first, then the pickers"
    print("run form heights (px at 1,400 x 900):", heights)
    too_tall = {n: h for n, h in heights.items() if h > MOST_SCREENS * SCREEN[1]}
    assert not too_tall, f"forms over {MOST_SCREENS} screens of {SCREEN}: {too_tall}"


def test_browser_the_mlflow_links_open_on_the_runs_and_the_registry(served: Served) -> None:
    """The links imageops prints (`serve`'s MLflow UI line, each run's page): MLflow's model
    training view, with the experiment's runs table and the registry one click away, not its
    GenAI overview (traces, token usage)."""
    from mlflow.tracking import MlflowClient

    from tasks.shared.settings import Settings
    from tasks.shared.tracking import ui_url

    client = MlflowClient(tracking_uri=served.mlflow, registry_uri=served.mlflow)
    experiment = client.get_experiment_by_name("imageops")
    (run,) = client.search_runs([experiment.experiment_id], max_results=1)
    printed = re.search(r"MLflow UI\s+(\S+)", served.log.read_text()).group(1)
    link = ui_url(
        Settings(mlflow_tracking_uri=served.mlflow), f"experiments/{experiment.experiment_id}"
    )
    assert printed == f"{link.split('?')[0]}/runs?{link.split('?')[1]}"
    for url in (printed, link):
        with browser_page() as page:
            page.goto(url)
            page.get_by_text(run.info.run_name).first.wait_for(timeout=60_000)
            text = page.inner_text("body")
            assert "Token Usage" not in text and "Detect Issues" not in text, text[:1500]
            if url == printed:
                shoot(page, "mlflow-experiment-runs")
            page.get_by_role("link", name="Models", exact=True).first.click()
            page.get_by_text(MODEL).first.wait_for(timeout=60_000)
    # MLflow's own links carry no workflowType: a first visit by one (a fresh browser, the
    # experiment's bare address) still opens on the runs table, and the run a click opens is
    # in the model view, the assistant panel closed (app/mlflow_ui.py).
    with browser_page() as page:
        page.goto(f"{served.mlflow}/#/experiments/{experiment.experiment_id}")
        page.get_by_text(run.info.run_name).first.wait_for(timeout=60_000)
        page.get_by_text(run.info.run_name).first.click()
        page.get_by_text("About this run").first.wait_for(timeout=60_000)
        assert page.evaluate("localStorage.getItem('mlflow.workflowType_v1')") == (
            '"machine_learning"'
        )
        assert "Ask a question" not in page.inner_text("body")  # the assistant's panel
    # A training run's charts: the per-epoch curves (train/..., val/...) first, the one-figure
    # summaries (best_val_top1, best_epoch) after them (tasks.shared.tracking.summary_metric).
    (trained,) = client.search_runs(
        [experiment.experiment_id], "metrics.best_val_top1 >= 0", max_results=1
    )
    with browser_page() as page:
        page.goto(f"{served.mlflow}/#/experiments/{experiment.experiment_id}/runs/"
                  f"{trained.info.run_id}/model-metrics")  # fmt: skip
        page.get_by_text("best_val_top1").first.wait_for(timeout=60_000)
        text = page.inner_text("body")
        sections = re.findall(r"^(.+)\n\((\d+)\)$", text, re.MULTILINE)  # "train", "(4)"
        assert [name for name, _ in sections][:3] == ["train", "val", "Model metrics"], sections
        page.locator(".js-plotly-plot").nth(6).wait_for(timeout=60_000)  # drawn, for the picture
        shoot(page, "mlflow-run-charts")


def test_browser_the_training_report_fits_its_panel(served: Served) -> None:
    """The report a person opens from the train run: its curves and per-epoch table inside the
    artifact panel, nothing cut off at the right edge."""
    with served.client() as client:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

        query = ArtifactFilter(key=ArtifactFilterKey(any_=["training-report"]))
        (report, *_) = client.read_artifacts(artifact_filter=query)
    ui = served.api.removesuffix("/api")
    with browser_page(served.auth) as page:
        page.goto(f"{ui}/artifacts/artifact/{report.id}")
        page.get_by_text("train loss", exact=True).first.wait_for(timeout=60_000)
        overflowing = page.evaluate(
            """() => [...document.querySelectorAll('table')]
                .filter(t => t.scrollWidth > t.parentElement.clientWidth + 1)
                .map(t => [t.scrollWidth, t.parentElement.clientWidth, t.rows[0].innerText])"""
        )
        assert page.locator("table").count() >= 1
        assert not overflowing, overflowing
        shoot(page, "prefect-training-report", full_page=True)


def test_browser_a_training_is_watched_from_its_prefect_run_page(
    served: Served, registered_version: str
) -> None:
    """Issue 47, point 3, as a person sees it: the training's sub-run is named after what it
    trains, its page's log holds the epoch lines and the rounded end line, and its Artifacts tab
    the progress artifact, at 100 once it has ended."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with served.client() as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="training-resnet18-"))
        )
    run = next(r for r in runs if r.state is not None and r.state.is_completed())
    epochs = run.parameters["request"]["params"]["epochs"]
    assert run.name == f"training-resnet18-{epochs}-epoch" + ("s" if epochs > 1 else ""), run.name
    ui = served.api.removesuffix("/api")
    with browser_page(served.auth) as page:
        page.goto(f"{ui}/runs/flow-run/{run.id}")
        page.get_by_text(re.compile(r"epoch 1/\d+: train loss \d+\.\d{4}")).first.wait_for(
            timeout=60_000
        )
        page.get_by_text("training finished").first.wait_for(timeout=60_000)
        # named before its first line, which carried Prefect's random name
        page.get_by_text(f"Beginning subflow run '{run.name}'").first.wait_for(timeout=60_000)
        shoot(page, "prefect-training-run")
        page.locator("li.p-tab", has_text="Artifacts").click()  # the run page's tabs
        page.get_by_text("training-progress").first.wait_for(timeout=60_000)
    assert float(served.artifact(run.id, "training-progress").data) == 100.0


@pytest.fixture
def registered_version(served: Served, digits_split: tuple[Path, Path]) -> str:
    """A version of the model in the served registry: the one the form and CLI runs registered,
    else one trained here (when this test runs alone)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=served.mlflow, registry_uri=served.mlflow)
    versions = client.search_model_versions(f"name = '{MODEL}'") if client.search_registered_models(
        f"name = '{MODEL}'") else []  # fmt: skip
    if not versions:
        train_dir, val_dir = digits_split
        with served.client() as prefect:
            run = prefect.create_flow_run_from_deployment(
                served.deployment("imageops-train-model/train").id,
                parameters={
                    "train_data": str(train_dir), "val_data": str(val_dir),
                    "params": {"epochs": 1, "nproc_per_node": 1},
                    "transform": {"resize_size": 16, "center_crop_size": 16},
                    "steps": {"version_data": False},
                },
            )  # fmt: skip
        served.wait("a model to train and register", served.finished([run.id]), 420)
        versions = client.search_model_versions(f"name = '{MODEL}'")
    return max(versions, key=lambda v: int(v.version)).version


def test_browser_champion_set_by_clicks_scores_that_version(
    served: Served, registered_version: str, digits_split: tuple[Path, Path]
) -> None:
    """In MLflow's registry page: Aliases, Add (or the pencil), type champion, Save. MLflow's
    webhook reaches the receiver, Prefect's trigger starts the score deployment with that
    version, and it completes; the version's tag says since when and how it became champion."""
    from mlflow.tracking import MlflowClient

    # The score deployment's images (data/digits/val), where a person's project keeps them.
    images = served.root / "data" / "digits" / "val"
    if not images.exists():
        shutil.copytree(digits_split[1], images)
    score = served.deployment("imageops-score/score")
    before = {r.id for r in served.flow_runs(score.id)}
    with browser_page() as page:
        page.goto(f"{served.mlflow}/#/models/{MODEL}/versions/{registered_version}")
        # the Aliases row's button: "Add" on a version without one, "Edit aliases" with one
        aliases = page.locator("[data-testid=descriptions-item]", has_text="Aliases")
        aliases.get_by_role("button").click()
        dialog = page.get_by_role("dialog")
        dialog.get_by_role("combobox").fill("champion")
        dialog.get_by_role("combobox").press("Enter")
        dialog.get_by_role("button", name="Save aliases").click()
        dialog.wait_for(state="hidden", timeout=30_000)
        page.get_by_text("@ champion").first.wait_for(timeout=30_000)
        shoot(page, "mlflow-model-champion")

    def started() -> list | None:
        runs = [r for r in served.flow_runs(score.id) if r.id not in before]
        # not the daily schedule's (models:/...@champion, resolved when it starts)
        return [r for r in runs if not r.parameters["model"].endswith("@champion")] or None

    (run,) = served.wait("the trigger to start a scoring run", started, timeout_s=120)
    assert run.parameters["model"] == f"models:/{MODEL}/{registered_version}"
    assert run.parameters["cluster"] == "team"  # no IMAGEOPS_RAY_ADDRESS here: scored here
    (done,) = served.wait("the scoring run to complete", served.finished([run.id]), timeout_s=300)
    assert done.name == f"score-{MODEL}-v{registered_version}-val", done.name
    # Its report, in the Prefect UI: a header row, and the accuracy on the labelled images.
    report = served.artifact(run.id, "scoring-report")
    with browser_page(served.auth) as page:
        page.goto(f"{served.api.removesuffix('/api')}/artifacts/artifact/{report.id}")
        page.get_by_text(re.compile(r"labelled images")).first.wait_for(timeout=60_000)
        headers = page.locator("th").all_inner_texts()
        shown = page.inner_text("body")
        shoot(page, "prefect-scoring-report")
    assert headers[:2] == ["scoring", "this run"], headers
    assert re.search(r"accuracy\s+\d\.\d{4} \(\d+ of \d+ labelled images\)", shown), shown
    client = MlflowClient(tracking_uri=served.mlflow, registry_uri=served.mlflow)
    tags = client.get_model_version(MODEL, registered_version).tags
    assert tags["champion"] == "yes", tags
    assert tags["champion.record"].startswith("yes, since "), tags
    assert tags["champion.record"].endswith("(by hand in the MLflow registry)"), tags
    # The registry's version list: the champion tags whole, a word or two; details on the page.
    with browser_page() as page:
        page.goto(f"{served.mlflow}/#/models/{MODEL}")
        page.locator('span[title="champion"]').first.wait_for(timeout=60_000)
        shown = page.evaluate(
            """() => [...document.querySelectorAll('span[title="champion"]')].map(key => {
                const value = key.nextElementSibling;
                return [value.title, value.scrollWidth <= value.clientWidth + 1];
            })"""
        )
        shoot(page, "mlflow-model-versions")
    assert shown and all(whole for _, whole in shown), shown
    assert all(re.fullmatch(r"yes|was|before v\d+", value) for value, _ in shown), shown


def test_the_prefect_cli_lists_what_the_stack_holds(served: Served) -> None:
    """The `prefect` command's listings against the served API (422 with fastapi >= 0.151);
    `prefect deployment ls` is run from the printed exports (the test above)."""
    flows = served.prefect("flow", "ls")
    for name in ("imageops-train-model", "imageops-pipeline"):
        assert name in flows
    assert re.search(r"\blocal\b.*\bprocess\b", served.prefect("work-pool", "ls"))
    # The training runs of the tests before: their flow runs complete a moment after MLflow's.
    served.wait(
        "a completed training flow run in `prefect flow-run ls`",
        lambda: "train-resnet18" in served.prefect("flow-run", "ls", "--state-type", "COMPLETED"),
        timeout_s=60,
    )
    assert "training-report" in served.prefect("artifact", "ls")

    train = served.deployment("imageops-train-model/train")
    (run, *_) = served.flow_runs(train.id, ["COMPLETED"])
    logs = served.prefect("flow-run", "logs", str(run.id))
    assert f"Flow run '{run.name}' - Worker 'imageops-local-worker' submitting" in logs
    assert f"Flow run '{run.name}' - Finished in state Completed" in logs


def test_a_partial_pipeline_config_keeps_the_demo_values(served: Served) -> None:
    """`prefect deployment run imageops-pipeline/pipeline -p 'config={...}'` with one section.

    The run stops at its first check (its source holds the data folder it would write), after
    logging the configuration it resolved: that is what it would have trained with.
    """
    typed = served.prefect(
        "deployment", "run", "imageops-pipeline/pipeline",
        "-p", 'config={"train": {"epochs": 1}, "source": ".", "dataset": "partial"}',
    )  # fmt: skip
    (run_id,) = re.findall(r"UUID: ([0-9a-f-]{36})", typed)
    (run,) = served.wait("the pipeline run to stop", served.finished([UUID(run_id)], ok=False))
    assert run.state_type.value == "FAILED"

    def resolved() -> dict | None:  # the log may reach the API a moment after the state
        logs = served.prefect("flow-run", "logs", run_id)
        line = re.search(r"Pipeline parameters: (\{.*\})", logs)
        return json.loads(line.group(1)) if line else None

    config = served.wait("the run's parameters in its log", resolved, timeout_s=30)
    assert config["train"]["epochs"] == 1
    assert config["train"]["nproc_per_node"] == 2  # the deployment's, not the class's 1
    assert config["transform"]["center_crop_size"] == 32  # and the demo's transform
    assert config["model"] == {
        "name": "resnet18", "pretrained": False,
        "memory_efficient": False, "zero_init_residual": False,
    }  # fmt: skip


def test_the_stacks_state_is_open_to_no_other_user(served: Served) -> None:
    """Databases, artifacts, the DVC remote, logs and secrets, after the other tests used the
    stack: nothing another local user may read or write (issue 43, finding 5)."""
    home = served.root / ".imageops"
    assert {"mlflow.db", "stack"} <= {p.name for p in home.iterdir()}
    assert (home / "prefect" / "prefect.db").is_file()  # one history with `imageops run`
    assert open_to_others(home) == []


def test_ctrl_c_or_sigterm_stops_every_process_within_10_s_and_a_restart_works_until_a_service_dies(
    served: Served,
) -> None:
    """Ctrl-C stops the stack; started again at once on the same ports (their connections still
    in TIME_WAIT), SIGTERM (a scheduler's stop) stops it too; started a third time, one of its
    services dies: the stack stops, naming it and the end of its log. Nothing is left each time."""

    def stopped_within_10_s(process: subprocess.Popen, sig: signal.Signals, log: Path) -> None:
        children = psutil.Process(process.pid).children(recursive=True)
        assert len(children) >= 4  # two servers, the receiver, the worker (and their children)
        pressed = time.monotonic()
        process.send_signal(sig)
        assert process.wait(timeout=60) == 0, log.read_text()[-3000:]
        _, alive = psutil.wait_procs(children, timeout=15)
        took = time.monotonic() - pressed
        assert not alive, [p.cmdline() for p in alive]
        said = log.read_text()
        assert took < 10, f"{sig.name} took {took:.1f} s to stop the stack\n{said[-1500:]}"
        assert re.search(r"stopped in \d+\.\d s", said), said[-1500:]

    def start_again(name: str) -> tuple[subprocess.Popen, Path]:
        log = served.root / f"{name}.log"
        again = servers.start(served.command, log, served.env, cwd=served.root)
        ready = servers.wait_until(lambda: again.poll() is not None or "ready" in log.read_text(),
                                   240, interval_s=0.5)  # fmt: skip
        assert ready and again.poll() is None, log.read_text()[-3000:]
        assert servers.healthy(f"{served.api}/health")
        return again, log

    stopped_within_10_s(served.process, signal.SIGINT, served.log)
    started: list[subprocess.Popen] = []
    try:
        again, log = start_again("serve-again")
        started.append(again)
        stopped_within_10_s(again, signal.SIGTERM, log)

        third, log = start_again("serve-third")
        started.append(third)
        children = psutil.Process(third.pid).children(recursive=True)
        (receiver,) = [p for p in children if "app.webhook" in " ".join(p.cmdline())]
        receiver.kill()
        assert third.wait(timeout=30) == 2, log.read_text()[-3000:]
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, [p.cmdline() for p in alive]
        said = log.read_text()
        assert "error: ImageOpsError: receiver exited with code -9. End of" in said, said[-3000:]
        assert "receiver.log" in said and "Traceback" not in said, said[-3000:]
    finally:
        for process in started:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                process.wait(timeout=60)
