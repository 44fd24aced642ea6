"""KubeRay, checked on paper: the RayCluster manifest against the CRD KubeRay publishes.

No cluster and no network: the committed ``deployments/kuberay/raycluster.yaml`` and freshly
generated manifests are validated against the ray.io/v1 ``openAPIV3Schema`` of KubeRay's own CRD
(``tests/data/kuberay/ray.io_rayclusters.yaml``, vendored unchanged), the way the API server
checks a ``kubectl apply``. A misspelt or mistyped field must be refused, so the check can fail.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from jsonschema import Draft4Validator, FormatChecker, ValidationError, validators
from projects import imageops

from app.kuberay import (
    GCS_PORT,
    KUBERAY_VERSION,
    SECRET_KEYS,
    SECRET_NAME,
    SERVER_VARIABLES,
    head_address,
    manifest_text,
    raycluster,
    server_addresses,
)
from app.work_pools import base_job_template
from tasks.shared.errors import InvalidParameterError
from tasks.shared.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "deployments" / "kuberay" / "raycluster.yaml"
CRD = ROOT / "tests" / "data" / "kuberay" / "ray.io_rayclusters.yaml"


def _structural(node: dict[str, Any]) -> dict[str, Any]:
    """A CRD schema in jsonschema's terms, with the Kubernetes rules plain JSON Schema lacks.

    - Unknown fields: the API server drops them from an object whose schema lists ``properties``
      (unless ``x-kubernetes-preserve-unknown-fields``), and ``kubectl apply`` (strict field
      validation, its default) refuses them: here ``additionalProperties: false``. An object
      with no ``properties`` (``metadata``: the server checks it as ObjectMeta) stays open.
    - ``x-kubernetes-int-or-string``: an integer or a string (``nvidia.com/gpu: 1`` or ``"1"``);
      controller-gen writes the matching ``anyOf`` beside every one, and jsonschema applies that.
    - ``nullable``: null is allowed too (OpenAPI 3.0, not JSON Schema).
    - ``x-kubernetes-list-type`` map / set: no two items with the same keys (see _list_type).
    - ``x-kubernetes-validations`` are CEL rules (immutability, managedBy's values) that only an
      API server evaluates; the manifest sets none of the fields they guard.
    """
    schema = dict(node)
    if "properties" in schema:
        schema["properties"] = {name: _structural(s) for name, s in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            schema["additionalProperties"] = False
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            schema[key] = _structural(schema[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            schema[key] = [_structural(s) for s in schema[key]]
    if schema.pop("nullable", False) and "type" in schema:
        schema["type"] = [schema["type"], "null"]
    return schema


def _list_type(
    validator: Any, list_type: str, instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    """A list-map (env by name, ports by port and protocol) or set holds each key once."""
    if not validator.is_type(instance, "array") or list_type not in ("map", "set"):
        return
    if list_type == "map":
        fields = schema["x-kubernetes-list-map-keys"]
        keys = [json.dumps([item.get(f) for f in fields]) for item in instance]
    else:
        keys = [json.dumps(item, sort_keys=True) for item in instance]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        yield ValidationError(f"duplicate entries {', '.join(repeated)} in a {list_type} list")


KubernetesValidator = validators.extend(Draft4Validator, {"x-kubernetes-list-type": _list_type})
FORMATS = FormatChecker()


@FORMATS.checks("int32")
def _int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@FORMATS.checks("int64")
def _int64(value: object) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


@cache
def _validator() -> Any:
    """The validator of KubeRay's ray.io/v1 RayCluster schema (the CRD is read once)."""
    crd = yaml.load(CRD.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)
    assert crd["spec"]["names"]["kind"] == "RayCluster"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert v1["served"] and v1["storage"]
    return KubernetesValidator(_structural(v1["schema"]["openAPIV3Schema"]), format_checker=FORMATS)


def schema_errors(manifest: dict[str, Any]) -> list[str]:
    """Every way ``manifest`` breaks the CRD schema, as ``path: message`` (none: it is valid)."""
    return [
        f"{'.'.join(str(p) for p in err.absolute_path)}: {err.message}"
        for err in _validator().iter_errors(manifest)
    ]


def generated(**options: Any) -> dict[str, Any]:
    """A manifest from the generator, with the placeholder server addresses."""
    return raycluster(server_addresses(Settings()), **options)


@pytest.fixture
def no_server_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """No IMAGEOPS_* server address in the environment: the defaults the committed file has."""
    for variable in SERVER_VARIABLES:
        monkeypatch.delenv(variable, raising=False)


def test_the_vendored_crd_is_the_release_the_manifest_names() -> None:
    assert f"#   release: v{KUBERAY_VERSION} " in CRD.read_text(encoding="utf-8")
    assert f"--version {KUBERAY_VERSION}" in COMMITTED.read_text(encoding="utf-8")


def test_committed_manifest_is_what_the_command_writes(
    project: Settings, no_server_settings: None
) -> None:
    written = project.project_root / "raycluster.yaml"
    result = imageops("cluster", "manifest", "--out", str(written), cwd=project.project_root)
    assert result.returncode == 0, result.stderr
    committed = COMMITTED.read_text(encoding="utf-8")
    assert written.read_text(encoding="utf-8") == committed, (
        "deployments/kuberay/raycluster.yaml is stale: run "
        "`imageops cluster manifest --out deployments/kuberay/raycluster.yaml`"
    )
    printed = imageops("cluster", "manifest", cwd=project.project_root)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == committed


def test_committed_manifest_is_valid_against_the_crd() -> None:
    manifest = yaml.safe_load(COMMITTED.read_text(encoding="utf-8"))
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayCluster"
    assert schema_errors(manifest) == []
    assert f"cluster address (`--cluster` / `cluster` in the form) {head_address()}" in (
        " ".join(line.lstrip("# ") for line in COMMITTED.read_text().splitlines())
    )


@pytest.mark.parametrize(("nodes", "gpus"), [(1, 1), (2, 1), (3, 4), (16, 8)])
def test_generated_manifests_follow_the_options(
    no_server_settings: None, nodes: int, gpus: int
) -> None:
    manifest = generated(nodes=nodes, gpus_per_node=gpus, name=f"train-{nodes}x{gpus}")
    assert schema_errors(manifest) == []
    # and it survives the trip through the file kubectl reads
    assert yaml.safe_load(manifest_text(manifest)) == manifest

    spec = manifest["spec"]
    (group,) = spec["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == nodes
    pod = group["template"]["spec"]
    (worker,) = pod["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == gpus
    # the head takes no GPU work: none requested, and Ray told it has none
    (head,) = spec["headGroupSpec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    assert spec["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    assert head["ports"] == [{"name": "gcs", "containerPort": GCS_PORT}]

    # the gpu-k8s pool's own settings, and the Ray the flow run drives the cluster with
    assert spec["rayVersion"] == ray.__version__
    pool = base_job_template("gpu-k8s")["variables"]["properties"]
    assert head["image"] == worker["image"] == pool["image"]["default"]
    assert pod["nodeSelector"] == pool["node_selector"]["default"]
    assert pod["tolerations"] == pool["tolerations"]["default"]
    (shm,) = pod["volumes"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": pool["shm_size"]["default"]}
    assert {"name": shm["name"], "mountPath": "/dev/shm"} in worker["volumeMounts"]
    env = {item["name"]: item.get("value") for item in worker["env"]}
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"


def test_image_and_server_settings_reach_every_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IMAGEOPS_MLFLOW_TRACKING_URI", "http://mlflow.team.svc:5000")
    monkeypatch.setenv("IMAGEOPS_DVC_REMOTE_URL", "s3://team-bucket/dvc")
    manifest = raycluster(
        server_addresses(Settings()), image="registry.example.com/imageops-worker:0.1.0"
    )
    assert schema_errors(manifest) == []
    groups = [manifest["spec"]["headGroupSpec"], *manifest["spec"]["workerGroupSpecs"]]
    for group in groups:
        (container,) = group["template"]["spec"]["containers"]
        assert container["image"] == "registry.example.com/imageops-worker:0.1.0"
        env = {item["name"]: item.get("value") for item in container["env"]}
        assert env["IMAGEOPS_MLFLOW_TRACKING_URI"] == "http://mlflow.team.svc:5000"
        assert env["IMAGEOPS_DVC_REMOTE_URL"] == "s3://team-bucket/dvc"
        assert set(SERVER_VARIABLES) <= set(env)


def test_no_secret_value_is_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in SECRET_KEYS:  # what a shell holding the credentials would have
        monkeypatch.setenv(key, f"secret-value-of-{key}")
    manifest = generated()
    assert "secret-value-of" not in manifest_text(manifest)
    for group in [manifest["spec"]["headGroupSpec"], *manifest["spec"]["workerGroupSpecs"]]:
        (container,) = group["template"]["spec"]["containers"]
        by_name = {item["name"]: item for item in container["env"]}
        for key, optional in SECRET_KEYS.items():
            assert "value" not in by_name[key]
            ref = by_name[key]["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"], ref.get("optional", False)) == (
                SECRET_NAME,
                key,
                optional,
            )


def test_an_address_with_a_password_is_refused(
    project: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IMAGEOPS_MLFLOW_TRACKING_URI", "http://alice:hunter2@mlflow.team.svc:5000")
    with pytest.raises(InvalidParameterError, match="carries a password"):
        server_addresses(Settings())
    result = imageops("cluster", "manifest", cwd=project.project_root)
    assert result.returncode == 2
    assert "IMAGEOPS_MLFLOW_TRACKING_URI" in result.stderr and SECRET_NAME in result.stderr
    assert "hunter2" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "options",
    [{"nodes": 0}, {"gpus_per_node": 0}, {"name": "Imageops"}, {"name": "x" * 54}],
)
def test_options_kuberay_would_refuse_are_refused(options: dict[str, Any]) -> None:
    with pytest.raises(InvalidParameterError):
        generated(**options)


def _worker(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]


def _misspelt_field(manifest: dict[str, Any]) -> None:
    group = manifest["spec"]["workerGroupSpecs"][0]
    group["replica"] = group.pop("replicas")


def _misspelt_container_field(manifest: dict[str, Any]) -> None:
    _worker(manifest)["volumeMount"] = _worker(manifest).pop("volumeMounts")


def _replicas_as_text(manifest: dict[str, Any]) -> None:
    manifest["spec"]["workerGroupSpecs"][0]["replicas"] = "2"


def _gpus_as_a_list(manifest: dict[str, Any]) -> None:
    _worker(manifest)["resources"]["limits"]["nvidia.com/gpu"] = [1]


def _no_group_name(manifest: dict[str, Any]) -> None:
    del manifest["spec"]["workerGroupSpecs"][0]["groupName"]


def _env_twice(manifest: dict[str, Any]) -> None:
    _worker(manifest)["env"].append({"name": "NCCL_SOCKET_IFNAME", "value": "ib0"})


def _replicas_past_int32(manifest: dict[str, Any]) -> None:
    manifest["spec"]["workerGroupSpecs"][0]["replicas"] = 2**31


@pytest.mark.parametrize(
    ("break_it", "where"),
    [
        (_misspelt_field, "spec.workerGroupSpecs.0"),
        (_misspelt_container_field, "spec.workerGroupSpecs.0.template.spec.containers.0"),
        (_replicas_as_text, "spec.workerGroupSpecs.0.replicas"),
        (_gpus_as_a_list, "spec.workerGroupSpecs.0.template.spec.containers.0.resources.limits"),
        (_no_group_name, "spec.workerGroupSpecs.0"),
        (_env_twice, "spec.workerGroupSpecs.0.template.spec.containers.0.env"),
        (_replicas_past_int32, "spec.workerGroupSpecs.0.replicas"),
    ],
)
def test_a_broken_manifest_is_refused(break_it: Any, where: str) -> None:
    manifest = copy.deepcopy(yaml.safe_load(COMMITTED.read_text(encoding="utf-8")))
    break_it(manifest)
    errors = schema_errors(manifest)
    assert errors, f"{break_it.__name__} passed the schema"
    assert any(error.startswith(f"{where}") for error in errors), errors
