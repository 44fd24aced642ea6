# The imageops worker image. It runs a Prefect worker (the default command), and it is the image the
# gpu-docker and gpu-k8s work pools start for every flow run: their workers replace the command
# with `prefect flow-run execute` (Kubernetes: the container args), which is why there is no
# ENTRYPOINT.
#
#   docker build -t imageops-worker:latest .
#
# Base: python:3.11-slim rather than a CUDA or pytorch/pytorch image. On Linux x86_64 the torch
# that requirements.lock pins is PyPI's CUDA 13.0 build: the CUDA runtime, cuDNN and NCCL come as
# pip packages (the lock's nvidia-* and cuda-* lines), so a CUDA base image would only add a second
# copy of them (several GB) and a second CUDA version to keep in step. The GPU host needs only the
# NVIDIA driver (CUDA 13.0 needs driver 580 or newer) and the NVIDIA Container Toolkit (Docker) or
# the NVIDIA GPU Operator / device plugin (Kubernetes).
#
# Older driver, or no GPU: install torch from a PyTorch wheel index instead; the lock's torch,
# torchvision, triton, nvidia-* and cuda-* lines are then replaced by that index's build of the
# same torch and torchvision versions:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 -t imageops-worker .
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t imageops-worker:cpu .
#
# Scoring on the GPU: the default build replaces the lock's onnxruntime with onnxruntime-gpu, the
# same runtime with the CUDA execution provider (built for CUDA 13, like the lock's torch, whose
# nvidia-* packages give it CUDA and cuDNN); `imageops score` then runs on the GPU when the
# container has one and on the CPU otherwise. A TORCH_INDEX_URL build keeps the CPU onnxruntime
# (PyPI's onnxruntime-gpu does not match another CUDA version).
FROM python:3.11-slim-bookworm

ARG TORCH_INDEX_URL=""
ARG ONNXRUNTIME_GPU_VERSION="1.31.1"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# git: DVC and the data version (`git rev-parse`) when a project checkout is mounted over the copy.
RUN apt-get update \
    && apt-get install --yes --no-install-recommends git \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 imageops \
    && install --directory --owner imageops --group imageops /opt/imageops

WORKDIR /opt/imageops

# Dependencies first, in a layer of their own: a code change does not reinstall torch.
COPY requirements.lock ./
RUN set -eu; \
    if [ -z "$TORCH_INDEX_URL" ]; then \
        pip install --requirement requirements.lock; \
        pip uninstall --yes onnxruntime; \
        pip install --no-deps "onnxruntime-gpu==$ONNXRUNTIME_GPU_VERSION"; \
    else \
        pip install --index-url "$TORCH_INDEX_URL" \
            $(grep -E '^(torch|torchvision)==' requirements.lock); \
        grep -vE '^(torch|torchvision|triton|nvidia-[^=]*|cuda-[^=]*)==' requirements.lock \
            > /tmp/requirements-without-torch.txt; \
        pip install --requirement /tmp/requirements-without-torch.txt; \
        rm /tmp/requirements-without-torch.txt; \
    fi

# The project (.dockerignore keeps out .git, environments, caches, .imageops state and data sets),
# installed in place as `make install` does, so the deployments' entrypoints (flows/*.py) and
# deployments/ are found under IMAGEOPS_PROJECT_ROOT, where prefect.yaml's pull step goes.
COPY --chown=imageops:imageops . .
RUN pip install --no-deps --no-build-isolation --editable . \
    && chown -R imageops:imageops imageops.egg-info

USER imageops

# IMAGEOPS_PROJECT_ROOT: the project copy (its .imageops/ holds local state unless the IMAGEOPS_*
# settings point at servers: run flows against a Prefect server, an MLflow server and a shared DVC
# remote, or mount a volume there). IMAGEOPS_WORK_POOL: the pool the default command serves.
ENV IMAGEOPS_PROJECT_ROOT=/opt/imageops \
    IMAGEOPS_WORK_POOL=local

# Set PREFECT_API_URL (docker run -e / the pod's env) to the Prefect server the worker polls, and
# PREFECT_API_AUTH_STRING to its login. The worker runs only what the project registered
# (docs/stack.md#what-a-worker-runs), not `prefect worker start`'s anything-the-API-says.
CMD ["sh", "-c", "exec python -m app.checked_worker --pool \"$IMAGEOPS_WORK_POOL\""]
