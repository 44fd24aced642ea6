"""The gpu-k8s pool's Ray cluster: a KubeRay RayCluster manifest with one GPU worker group.

On Kubernetes the cluster a training job runs on is made by the KubeRay operator from a RayCluster
resource. This builds that resource from the settings imageops already has, so nothing is written
twice: the image, pull policy, node selector, tolerations and /dev/shm size are the gpu-k8s work
pool's defaults (``deployments/work-pools/gpu-k8s.json``), the Ray version is the installed one
(head, workers and the flow run that drives them must run the same Ray), and the server addresses
are the ``IMAGEOPS_*`` settings. ``imageops cluster manifest`` prints it;
``deployments/kuberay/raycluster.yaml`` is its output with the defaults.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib.metadata import version
from typing import Any

import yaml

from tasks.shared.errors import InvalidParameterError
from tasks.shared.settings import Settings, redact_uri

# The KubeRay release the manifest is written and checked for (tests/data/kuberay holds its CRD).
KUBERAY_VERSION = "1.7.0"

DEFAULT_NAME = "imageops"
DEFAULT_NODES = 2
DEFAULT_GPUS_PER_NODE = 1
# KubeRay names the head's Service `<name>-head-svc`, and that must stay a DNS label: the operator
# refuses longer names (MaxRayClusterNameLength) and any that is not a DNS-1035 label.
MAX_NAME_LENGTH = 53
_DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")

GCS_PORT = 6379
# Fixed (Ray picks a random one) so that a worker's probe has a port to check.
RAYLET_PORT = 6380
GPU_GROUP = "gpu"
# The head schedules the cluster and keeps its state; it trains nothing (no GPU) and needs little.
HEAD_RESOURCES = {"cpu": "2", "memory": "8Gi"}

# What a node needs to reach the servers (it shares no filesystem with anyone): variable ->
# (the Settings field it comes from, the placeholder written when that setting is not set).
# A field Settings does not have yet gives its placeholder too.
SERVER_VARIABLES: dict[str, tuple[str, str]] = {
    "IMAGEOPS_MLFLOW_TRACKING_URI": ("mlflow_tracking_uri", "http://mlflow-server:5000"),
    "IMAGEOPS_DVC_REMOTE_URL": ("dvc_remote_url", "s3://imageops/dvc"),
    "IMAGEOPS_CHECKPOINT_URL": ("checkpoint_url", "s3://imageops/checkpoints"),
    "IMAGEOPS_S3_ENDPOINT_URL": ("s3_endpoint_url", "http://s3-server:8333"),
}

# Credentials come from this Secret, never inline: key -> optional (an MLflow server without
# basic auth needs no login, S3 always needs its keys).
SECRET_NAME = "imageops-credentials"
SECRET_KEYS: dict[str, bool] = {
    "AWS_ACCESS_KEY_ID": False,
    "AWS_SECRET_ACCESS_KEY": False,
    "MLFLOW_TRACKING_USERNAME": True,
    "MLFLOW_TRACKING_PASSWORD": True,
}

# gloo and NCCL otherwise find their address from the hostname, which may resolve to 127.0.0.1,
# and the peers then dial loopback. eth0 is the pod's interface under the common CNIs (Calico,
# Cilium, flannel, the cloud VPC CNIs); a pod with extra networks (Multus) may want another.
SOCKET_INTERFACE = "eth0"


def server_addresses(settings: Settings) -> dict[str, str]:
    """The server address of every ``SERVER_VARIABLES`` entry: its setting, else the placeholder.

    Raises InvalidParameterError for an address that carries a password: a manifest is shared
    and committed, so credentials go in the Secret.
    """
    values = settings.model_dump()
    addresses = {}
    for variable, (field, placeholder) in SERVER_VARIABLES.items():
        address = str(values.get(field) or placeholder)
        if redact_uri(address) != address:
            raise InvalidParameterError(
                f"{variable} = {redact_uri(address)} carries a password, which would be written "
                "into the manifest.",
                f"Set the address without user:password@ and put the login in the Kubernetes "
                f"Secret {SECRET_NAME} ({', '.join(SECRET_KEYS)}).",
            )
        addresses[variable] = address
    return addresses


def head_address(name: str = DEFAULT_NAME) -> str:
    """The Ray address of cluster ``name`` inside Kubernetes: the head Service KubeRay makes."""
    return f"{name}-head-svc:{GCS_PORT}"


def raycluster(
    servers: Mapping[str, str],
    *,
    nodes: int = DEFAULT_NODES,
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
    image: str | None = None,
    name: str = DEFAULT_NAME,
) -> dict[str, Any]:
    """The RayCluster resource (ray.io/v1): a CPU head and ``nodes`` pods of ``gpus_per_node`` GPUs.

    One worker pod is one training node: train with ``nodes`` nodes and ``gpus_per_node``
    processes per node. ``servers`` are the ``SERVER_VARIABLES`` values (:func:`server_addresses`);
    ``image`` defaults to the gpu-k8s pool's. Raises InvalidParameterError for a count below 1 or
    a name KubeRay refuses.
    """
    for option, count in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
        if count < 1:
            raise InvalidParameterError(f"{option} = {count}, expected an integer >= 1.")
    if len(name) > MAX_NAME_LENGTH or not _DNS_1035_LABEL.fullmatch(name):
        raise InvalidParameterError(
            f"RayCluster name {name!r} is not one KubeRay takes.",
            f"Use at most {MAX_NAME_LENGTH} lower-case letters, digits and '-', starting with a "
            "letter and not ending with '-'.",
        )
    from app.work_pools import base_job_template  # here: it loads Prefect, which --help need not

    variables = base_job_template("gpu-k8s")["variables"]["properties"]
    pool = {
        key: variable["default"] for key, variable in variables.items() if "default" in variable
    }
    container = {
        "image": image or pool["image"],
        "imagePullPolicy": pool["image_pull_policy"],
        "env": _environment(servers),
    }
    head = {
        "name": "ray-head",
        **container,
        "ports": [{"name": "gcs", "containerPort": GCS_PORT}],
        "resources": {"requests": HEAD_RESOURCES, "limits": HEAD_RESOURCES},
        **_probes(GCS_PORT),
    }
    worker = {
        "name": "ray-worker",
        **container,
        # KubeRay passes the GPU limit on to `ray start --num-gpus`.
        "resources": {"limits": {"nvidia.com/gpu": gpus_per_node}},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        **_probes(RAYLET_PORT),
    }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "imageops"}},
        "spec": {
            "rayVersion": version("ray"),
            "headGroupSpec": {
                "serviceType": "ClusterIP",
                # No GPU work is placed on the head, even on a GPU machine.
                "rayStartParams": {"num-gpus": "0"},
                "template": {"spec": {"containers": [head]}},
            },
            "workerGroupSpecs": [
                {
                    "groupName": GPU_GROUP,
                    # A training gang needs every node: no autoscaling below or above it.
                    "replicas": nodes,
                    "minReplicas": nodes,
                    "maxReplicas": nodes,
                    "rayStartParams": {"node-manager-port": str(RAYLET_PORT)},
                    "template": {
                        "spec": {
                            "containers": [worker],
                            "nodeSelector": pool["node_selector"],
                            "tolerations": pool["tolerations"],
                            # DataLoader workers and NCCL pass tensors through /dev/shm; the
                            # container default of 64Mi crashes them (the pool's shm_size).
                            "volumes": [
                                {
                                    "name": "dshm",
                                    "emptyDir": {"medium": "Memory", "sizeLimit": pool["shm_size"]},
                                }
                            ],
                        }
                    },
                }
            ],
        },
    }


def _environment(servers: Mapping[str, str]) -> list[dict[str, Any]]:
    """A node's variables: server addresses, the socket interface, credentials by Secret."""
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in servers.items()]
    env += [
        {"name": "NCCL_SOCKET_IFNAME", "value": SOCKET_INTERFACE},
        {"name": "GLOO_SOCKET_IFNAME", "value": SOCKET_INTERFACE},
    ]
    for key, optional in SECRET_KEYS.items():
        ref: dict[str, Any] = {"name": SECRET_NAME, "key": key}
        if optional:
            ref["optional"] = True
        env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return env


def _probes(port: int) -> dict[str, Any]:
    """Readiness and liveness as a TCP check of the node's own Ray port.

    KubeRay 1.7's own probes ask the dashboard agent over HTTP (for Ray 2.53 and later; wget,
    which the slim image lacks, before), and the image's plain ``ray`` (not ``ray[default]``)
    runs no agent HTTP server: they would never pass. KubeRay keeps the probes it is given.
    """
    check = {"tcpSocket": {"port": port}, "periodSeconds": 5}
    return {
        "readinessProbe": {**check, "initialDelaySeconds": 10, "failureThreshold": 10},
        "livenessProbe": {**check, "initialDelaySeconds": 30, "failureThreshold": 120},
    }


def manifest_text(cluster: Mapping[str, Any]) -> str:
    """``cluster`` as the YAML file ``kubectl apply -f`` takes, with how to apply and use it."""
    name = cluster["metadata"]["name"]
    group = cluster["spec"]["workerGroupSpecs"][0]
    nodes = group["replicas"]
    gpus = group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    secrets = "".join(f" \\\n#       --from-literal={key}=..." for key in SECRET_KEYS)
    header = f"""\
# A Ray cluster for the gpu-k8s work pool (KubeRay {KUBERAY_VERSION}): a CPU head and
# {nodes} GPU nodes (nvidia.com/gpu: {gpus} each).
# Generated by `imageops cluster manifest` (app/kuberay.py) from the gpu-k8s pool's defaults and
# the IMAGEOPS_* server settings; the addresses below are placeholders where none were set. Make
# your own rather than edit this one, e.g.:
#   imageops cluster manifest --nodes 4 --gpus-per-node 8 \\
#       --image registry.example.com/imageops-worker:0.1.0 --out raycluster.yaml
# Apply it to a cluster with the NVIDIA GPU Operator (or device plugin) and the KubeRay operator:
#   helm repo add kuberay https://ray-project.github.io/kuberay-helm/
#   helm install kuberay-operator kuberay/kuberay-operator --version {KUBERAY_VERSION}
#   # the S3 keys, and the MLflow login where the MLflow server asks for one:
#   kubectl create secret generic {SECRET_NAME}{secrets}
#   kubectl apply -f raycluster.yaml
# Train on it: run the train deployment on the gpu-k8s pool with the cluster address
# (`--cluster` / `cluster` in the form) {head_address(name)}, the head's Service that KubeRay
# makes ({name}-head-svc.<namespace>.svc.cluster.local:{GCS_PORT} from another namespace), and
# `--nodes {nodes} --nproc-per-node {gpus}` (one process per GPU).
"""
    return header + yaml.dump(dict(cluster), Dumper=_PlainDumper, sort_keys=False, width=100)


class _PlainDumper(yaml.SafeDumper):
    """YAML without anchors: the head and workers share one env list, written out in both."""

    def ignore_aliases(self, data: Any) -> bool:
        return True
