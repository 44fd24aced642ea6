"""Work pools: each base job template rendered by its worker's own job configuration class.

No Prefect API and no Docker engine or cluster: rendering needs neither (the templates reference no
blocks or Prefect variables; the client below is never contacted), and the checks stop where the
worker hands its settings to docker-py's ``containers.create`` or to the Kubernetes API.
"""

from __future__ import annotations

import asyncio
import json
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

from app.work_pools import POOLS, base_job_template, work_pool_create

WORKERS = {"local": ProcessWorker, "gpu-docker": DockerWorker, "gpu-k8s": KubernetesWorker}
# A flow-run container reaches the API by its address (a local one would make the Docker worker
# ask the engine for its version to map host.docker.internal).
API_URL = "http://prefect-server:4200/api"


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
    # (container_create_kwargs is what the gpu-docker template fills in itself).
    default = WORKERS[pool].get_default_base_job_template()["variables"]["properties"]
    assert set(default) - {"container_create_kwargs"} <= set(template["variables"]["properties"])


def test_local_pool_is_the_process_worker_default() -> None:
    assert base_job_template("local") == ProcessWorker.get_default_base_job_template()
    config = render(ProcessJobConfiguration, "local", {"env": {"IMAGEOPS_HOME": "/data/x"}})
    assert config.env["IMAGEOPS_HOME"] == "/data/x"
    assert config.command  # the worker's own `prefect flow-run execute` command


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
        {"gpus": 2, "shm_size": "16g", "image": "registry.example/imageops-worker:1.2"}
    )
    assert settings["image"] == "registry.example/imageops-worker:1.2"
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
