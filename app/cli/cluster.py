"""Cluster commands: the KubeRay manifest of the Ray cluster the gpu-k8s pool trains on."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from app.cli.root import cluster_app, out
from app.kuberay import (
    DEFAULT_GPUS_PER_NODE,
    DEFAULT_NAME,
    DEFAULT_NODES,
    manifest_text,
    raycluster,
    server_addresses,
)
from models.atomic import write_text
from tasks.shared.settings import get_settings


@cluster_app.command("manifest")
def cluster_manifest(
    nodes: Annotated[
        int,
        typer.Option(
            min=1,
            help="Training nodes: GPU worker pods, one Ray node each (the job's --nodes).",
        ),
    ] = DEFAULT_NODES,
    gpus_per_node: Annotated[
        int,
        typer.Option(
            min=1,
            help="GPUs of each worker pod (its nvidia.com/gpu limit): the job's --nproc-per-node.",
        ),
    ] = DEFAULT_GPUS_PER_NODE,
    image: Annotated[
        str | None,
        typer.Option(
            help="Image of every Ray pod, the one the flow runs use. Default: the gpu-k8s "
            "pool's (deployments/work-pools/gpu-k8s.json), imageops-worker:latest."
        ),
    ] = None,
    name: Annotated[
        str,
        typer.Option(
            help="RayCluster name; the cluster address is then NAME-head-svc:6379 (the head "
            "Service KubeRay makes)."
        ),
    ] = DEFAULT_NAME,
    out_file: Annotated[
        Path | None,
        typer.Option("--out", help="Write the manifest to this file instead of printing it."),
    ] = None,
) -> None:
    """The RayCluster manifest (KubeRay) of a GPU Ray cluster, for `kubectl apply -f`.

    Server addresses: the IMAGEOPS_* settings, else placeholders. Credentials: a Secret.
    """
    cluster = raycluster(
        server_addresses(get_settings()),
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        image=image,
        name=name,
    )
    text = manifest_text(cluster)
    if out_file is None:
        # Plain stdout: rich would wrap and colour what `> file` or `| kubectl apply -f -` reads.
        typer.echo(text, nl=False)
    else:
        write_text(out_file, text)
        out.print(f"wrote {out_file}: kubectl apply -f {out_file}")
