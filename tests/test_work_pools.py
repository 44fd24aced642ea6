"""Work pools: each base job template rendered by its worker's own job configuration class.

No job variable decides what a worker runs: a caller's ``command`` (or an environment, folder,
image or kubeconfig that would run other code) is refused by the pool's schema and, were it sent
anyway, left unused by the rendered configuration. ``tests/test_team.py`` sends one to a real
server and worker.

No Prefect API and no Docker engine or cluster: rendering needs neither (the templates reference no
blocks or Prefect variables; the client below is never contacted), and the checks stop where the
worker hands its settings to docker-py's ``containers.create`` or to the Kubernetes API.
"""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace
from typing import Any
from uuid import uuid4

import docker
import pytest
from docker.models.containers import _create_container_args
from kubernetes_asyncio.client import ApiClient
from prefect.client.orchestration import PrefectClient
from prefect.client.schemas.objects import FlowRun
from prefect.server.schemas.actions import WorkPoolCreate as ServerWorkPoolCreate
from prefect.utilities.schema_tools import ValidationError, is_valid_schema, validate
from prefect.workers.process import ProcessJobConfiguration, ProcessWorker
from prefect_docker.worker import DockerWorker, DockerWorkerJobConfiguration
from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

from app.work_pools import FIXED, POOLS, base_job_template, work_pool_create

WORKERS = {"local": ProcessWorker, "gpu-docker": DockerWorker, "gpu-k8s": KubernetesWorker}
# A flow-run container reaches the API by its address (a local one would make the Docker worker
# ask the engine for its version to map host.docker.internal).
API_URL = "http://prefect-server:4200/api"
# What a caller would send to run its own command: each must change nothing the worker runs.
HOSTILE = {
    "command": "touch /tmp/imageops-pwned",
    "env": {"PYTHONWARNINGS": "all:0:antigravity.x:0:0", "BROWSER": "touch /tmp/x #%s"},
    "working_dir": "/tmp",
    "privileged": True,
    "volumes": ["/:/host"],
    "image": "attacker.example/imageops-worker:latest",
    "cluster_config": {"config": {}, "context_name": "x"},
}


def render(config_class: Any, pool: str, values: dict[str, Any]) -> Any:
    """The job configuration a worker of ``pool`` builds from the pool template and job variables.

    The same ``from_template_and_values`` and ``prepare_for_flow_run`` the worker runs per flow run.
    """
    unused_client = PrefectClient(api="http://127.0.0.1:9/api")
    config = asyncio.run(
        config_class.from_template_and_values(base_job_template(pool), values, client=unused_client)
    )
    config.prepare_for_flow_run(FlowRun(id=uuid4(), name="gpu-run", flow_id=uuid4()))
    return config


def check_job_variables(pool: str, values: dict[str, Any]) -> None:
    """Validate job variables as the Prefect server does when a flow run is created on ``pool``.

    The call prefect.server.api.validation makes (importing that module costs seconds): the pool's
    defaults overlaid with the run's variables, checked against the pool's ``variables`` schema.
    """
    schema = base_job_template(pool)["variables"]
    defaults = {k: v["default"] for k, v in schema["properties"].items() if "default" in v}
    validate(
        {**defaults, **values},
        schema,
        raise_on_error=True,
        preprocess=True,
        ignore_required=False,
        allow_none_with_default=True,
    )


@pytest.mark.parametrize("pool", POOLS)
def test_each_template_is_a_valid_work_pool_of_its_type(pool: str) -> None:
    template = base_job_template(pool)
    assert POOLS[pool] == WORKERS[pool].type
    # What the server checks on `prefect work-pool create`: placeholders declared, schema valid,
    # defaults valid against it (and, for a flow run, no required variable left without a value).
    ServerWorkPoolCreate(name=pool, type=POOLS[pool], base_job_template=template)
    is_valid_schema(template["variables"], preprocess=False)
    check_job_variables(pool, {})
    assert work_pool_create(pool).base_job_template == template
    # Started from the worker's own default: every one of its variables is still offered
    # (container_create_kwargs is what the gpu-docker template fills in itself), except those
    # that would let a caller run code, which are fixed and refused.
    default = WORKERS[pool].get_default_base_job_template()["variables"]["properties"]
    offered = set(template["variables"]["properties"])
    assert set(default) - {"container_create_kwargs"} - set(FIXED[pool]) <= offered
    assert not offered & set(FIXED[pool])
    assert template["variables"]["additionalProperties"] is False
    assert "{{ command }}" not in json.dumps(template["job_configuration"])


@pytest.mark.parametrize("pool", POOLS)
def test_no_job_variable_replaces_the_workers_command(pool: str) -> None:
    for name, value in HOSTILE.items():
        with pytest.raises(ValidationError):
            check_job_variables(pool, {name: value})
    # Sent anyway (Prefect 3.8 validates only a deployment's runs): the worker's command stays.
    configs = {
        "local": ProcessJobConfiguration,
        "gpu-docker": DockerWorkerJobConfiguration,
        "gpu-k8s": KubernetesWorkerJobConfiguration,
    }
    # The container pools take `env` (names checked by the server) and `image` (from a list).
    hostile = {k: v for k, v in HOSTILE.items() if pool == "local" or k not in ("env", "image")}
    config = render(configs[pool], pool, hostile)
    assert "imageops-pwned" not in json.dumps(config.model_dump(mode="json"), default=str)
    assert "prefect" in config.command and "touch" not in config.command
    if pool == "local":
        assert config.working_dir is None
        assert config.env.get("BROWSER") == os.environ.get("BROWSER")
        assert config.env.get("PYTHONWARNINGS") == os.environ.get("PYTHONWARNINGS")
    if pool == "gpu-docker":
        assert config.privileged is False and config.volumes == []
    if pool == "gpu-k8s":
        assert config.cluster_config is None
        assert config.job_manifest["spec"]["template"]["spec"]["containers"][0]["args"][:3] == [
            "prefect", "flow-run", "execute",
        ]  # fmt: skip


def test_local_pool_runs_in_the_workers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IMAGEOPS_HOME", "/data/x")
    config = render(ProcessJobConfiguration, "local", {})
    assert config.env["IMAGEOPS_HOME"] == "/data/x"  # the worker's, e.g. from the join file
    assert config.command.endswith("-m prefect.engine")  # the worker's own command


def docker_create_settings(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(kwargs the Docker worker passes to containers.create, the HostConfig docker-py builds)."""
    config = render(
        DockerWorkerJobConfiguration, "gpu-docker", {"env": {"PREFECT_API_URL": API_URL}, **values}
    )
    # A client for an engine that is never contacted: only its API version is read.
    client = docker.DockerClient(base_url="unix:///nonexistent/docker.sock", version="1.44")
    settings = DockerWorker(work_pool_name="gpu-docker")._build_container_settings(client, config)
    create_args = _create_container_args(dict(settings, version=client.api._version))
    return settings, create_args["host_config"]


def test_gpu_docker_defaults_request_every_gpu_and_a_large_shm() -> None:
    settings, host_config = docker_create_settings({})
    assert settings["image"] == "imageops-worker:latest"
    assert settings["device_requests"] == [
        {"driver": "nvidia", "count": -1, "capabilities": [["gpu"]]}
    ]
    assert settings["shm_size"] == "8g"
    assert host_config["DeviceRequests"] == [
        {"Driver": "nvidia", "Count": -1, "DeviceIDs": [], "Capabilities": [["gpu"]], "Options": {}}
    ]
    assert host_config["ShmSize"] == 8 * 1024**3
    assert settings["command"].startswith("prefect flow-run execute")


def test_gpu_docker_job_variables_override_gpus_and_shm() -> None:
    settings, host_config = docker_create_settings(
        {"gpus": 2, "shm_size": "16g", "image": "imageops-worker:latest"}
    )
    assert settings["image"] == "imageops-worker:latest"
    assert host_config["DeviceRequests"][0]["Count"] == 2
    assert host_config["DeviceRequests"][0]["Capabilities"] == [["gpu"]]
    assert host_config["ShmSize"] == 16 * 1024**3


def k8s_job(values: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """(the Job manifest the Kubernetes worker submits, the same read back as a V1Job)."""
    config = render(KubernetesWorkerJobConfiguration, "gpu-k8s", values)
    manifest = config.job_manifest
    return manifest, asyncio.run(as_v1job(manifest))


async def as_v1job(manifest: dict[str, Any]) -> Any:
    """The manifest as the Kubernetes client's own model reads it: a misspelt field is dropped."""
    async with ApiClient() as api:
        return api.deserialize(SimpleNamespace(data=json.dumps(manifest)), "V1Job")


def test_gpu_k8s_defaults_put_one_gpu_on_a_gpu_node_with_a_memory_shm() -> None:
    manifest, job = k8s_job({})
    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "imageops-worker:latest"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    assert pod["volumes"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}
    ]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert container["args"][:3] == ["prefect", "flow-run", "execute"]  # prepared for the run

    spec = job.spec.template.spec
    assert spec.containers[0].resources.limits == {"nvidia.com/gpu": "1"}  # a quantity
    assert spec.containers[0].volume_mounts[0].mount_path == "/dev/shm"
    assert spec.volumes[0].empty_dir.medium == "Memory"
    assert spec.node_selector == {"nvidia.com/gpu.present": "true"}
    assert spec.tolerations[0].key == "nvidia.com/gpu"
    assert spec.tolerations[0].effect == "NoSchedule"


def test_gpu_k8s_job_variables_override_gpu_fields() -> None:
    taint = {"key": "gpu-pool", "operator": "Equal", "value": "h100", "effect": "NoSchedule"}
    values = {
        "gpus": 4,
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [taint],
        "shm_size": "32Gi",
        "memory_limit": "200Gi",
    }
    check_job_variables("gpu-k8s", values)
    manifest, job = k8s_job(values)
    pod = manifest["spec"]["template"]["spec"]
    limits = pod["containers"][0]["resources"]["limits"]
    assert limits == {"memory": "200Gi", "nvidia.com/gpu": 4}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == [taint]
    assert pod["volumes"][0]["emptyDir"]["sizeLimit"] == "32Gi"
    assert job.spec.template.spec.tolerations[0].value == "h100"


@pytest.mark.parametrize(
    ("pool", "values"),
    [
        ("gpu-docker", {"gpus": -1}),
        ("gpu-docker", {"gpus": 8, "shm_size": "512m"}),
        ("gpu-k8s", {"gpus": 8, "node_selector": {}, "tolerations": [], "shm_size": "1.5Gi"}),
    ],
)
def test_good_job_variables_pass_the_pool_schema(pool: str, values: dict[str, Any]) -> None:
    check_job_variables(pool, values)


@pytest.mark.parametrize(
    ("pool", "values"),
    [
        ("gpu-docker", {"gpus": 0}),
        ("gpu-docker", {"gpus": -2}),
        ("gpu-docker", {"gpus": "all"}),
        ("gpu-docker", {"gpus": 1.5}),
        ("gpu-docker", {"shm_size": "8 GB"}),
        ("gpu-k8s", {"gpus": 0}),
        ("gpu-k8s", {"gpus": -1}),
        ("gpu-k8s", {"gpus": "4"}),
        ("gpu-k8s", {"shm_size": "lots"}),
        ("gpu-k8s", {"node_selector": {"nvidia.com/gpu.count": 8}}),
        ("gpu-k8s", {"tolerations": [{"key": "nvidia.com/gpu", "effect": "Sometimes"}]}),
        ("gpu-k8s", {"tolerations": {"key": "nvidia.com/gpu"}}),
        ("local", {"command": "touch /tmp/x"}),
        ("local", {"env": {"IMAGEOPS_HOME": "/tmp"}}),
        ("local", {"working_dir": "/tmp"}),
        ("gpu-docker", {"command": "touch /tmp/x"}),
        ("gpu-docker", {"image": "attacker.example/imageops-worker:latest"}),
        ("gpu-docker", {"privileged": True}),
        ("gpu-docker", {"volumes": ["/:/host"]}),
        ("gpu-k8s", {"command": "touch /tmp/x"}),
        ("gpu-k8s", {"cluster_config": {"config": {}, "context_name": "x"}}),
        ("gpu-docker", {"env": {"LD_PRELOAD": "/tmp/x.so"}}),
        ("gpu-k8s", {"env": {"PYTHONWARNINGS": "all:0:antigravity.x:0:0"}}),
        ("gpu-k8s", {"env": {"PREFECT_API_URL": "http://elsewhere/api"}}),
    ],
)
def test_bad_job_variables_are_refused_by_the_pool_schema(
    pool: str, values: dict[str, Any]
) -> None:
    (field,) = values
    with pytest.raises(ValidationError, match=field):
        check_job_variables(pool, values)


def test_unknown_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="gpu-docker"):
        base_job_template("gpu")


# --- the checked worker (app/checked_worker.py): what the API says against the checkout ----------


def _flow_run_of(pool: str, template: dict[str, Any], **deployment: Any) -> tuple[Any, ...]:
    """A flow run of the `train` deployment as registered, with ``deployment`` changed."""
    from prefect.client.schemas.objects import WorkPool
    from prefect.client.schemas.responses import DeploymentResponse

    from app.checked_worker import registered_deployments

    train = registered_deployments()["train"]
    registered = {"name": "train", "entrypoint": train.entrypoint, "pull_steps": train.pull_steps,
                  "job_variables": {}, "enforce_parameter_schema": True}  # fmt: skip
    return (
        FlowRun(flow_id=uuid4(), name="a-run", job_variables={}),
        WorkPool(name=pool, type=POOLS[pool], base_job_template=template),
        DeploymentResponse(id=uuid4(), flow_id=uuid4(), **registered | deployment),
    )


SHELL_STEP = {"prefect.deployments.steps.run_shell_script": {"script": "id"}}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"entrypoint": "/tmp/x.py:f"}, "its entrypoint is '/tmp/x.py:f'"),
        ({"pull_steps": [SHELL_STEP]}, "its pull steps are [{'prefect.deployments.steps.run_shell"),
        ({"job_variables": {"name": "x"}}, "its job variables are {'name': 'x'}"),
        ({"enforce_parameter_schema": False}, "its parameters are not checked"),
        ({"name": "other"}, "deployment 'other' (entrypoint 'flows.train.train_model_flow'"),
    ],
    ids=["entrypoint", "pull-steps", "job-variables", "parameter-schema", "unknown-name"],
)
def test_the_worker_refuses_a_deployment_the_project_did_not_register(
    change: dict[str, Any], named: str
) -> None:
    from app.checked_worker import check_flow_run
    from tasks.shared.errors import UnregisteredCodeError

    flow_run, pool, deployment = _flow_run_of("local", base_job_template("local"))
    assert check_flow_run(flow_run, pool, deployment).entrypoint == deployment.entrypoint
    flow_run, pool, deployment = _flow_run_of("local", base_job_template("local"), **change)
    with pytest.raises(UnregisteredCodeError, match="refused flow run 'a-run'") as refused:
        check_flow_run(flow_run, pool, deployment)
    assert named in str(refused.value)


def test_the_worker_refuses_a_run_without_deployment_or_with_variables_not_offered() -> None:
    from app.checked_worker import check_flow_run
    from tasks.shared.errors import UnregisteredCodeError

    flow_run, pool, deployment = _flow_run_of("local", base_job_template("local"))
    with pytest.raises(UnregisteredCodeError, match="has no deployment"):
        check_flow_run(flow_run, pool, None)
    hostile = flow_run.model_copy(update={"job_variables": HOSTILE})
    with pytest.raises(UnregisteredCodeError, match=r"job variables \['cluster_config', 'command'"):
        check_flow_run(hostile, pool, deployment)


@pytest.mark.parametrize("pool", POOLS)
def test_each_pools_worker_refuses_a_changed_template_before_configuring(pool: str) -> None:
    """Each pool's worker (``checked_worker_class``): a template changed through the API (here
    every variable of HOSTILE it lacks, given a default, and a fixed command) is refused before
    the run is configured, naming each change; the client is never contacted."""
    from app.checked_worker import checked_worker_class
    from tasks.shared.errors import UnregisteredCodeError

    template = base_job_template(pool)
    template["job_configuration"]["command"] = "id"
    properties = template["variables"]["properties"]
    for name, value in HOSTILE.items():
        properties.setdefault(name, {"default": value})
    flow_run, work_pool, deployment = _flow_run_of(pool, template)
    worker = checked_worker_class(pool)
    with pytest.raises(UnregisteredCodeError) as refused:
        asyncio.run(
            worker.job_configuration.resolve_for_flow_run(
                flow_run, client=PrefectClient(api="http://127.0.0.1:9/api"), work_pool=work_pool,
                worker_name="w", deployment=deployment,
            )
        )  # fmt: skip
    said = str(refused.value)
    assert f"the base job template of work pool {pool!r} differs" in said
    assert "job_configuration.command added ('id')" in said
    assert "variables.properties.privileged" in said or pool != "gpu-docker"
