# syntax=docker/dockerfile:1.7
# The engine for NVIDIA GPUs: CUDA base image and PyPI's CUDA torch wheels.
#   docker build -f docker/engine-cuda.Dockerfile -t ghcr.io/infergate/engine:0.1.0-cuda .
# runtime, not devel: the engine's only attention backend is torch's SDPA, so nothing
# compiles kernels at run time. Not built or run on a GPU in this repository's CI.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY infergate infergate
COPY operator operator
COPY epp epp
COPY engine engine
RUN python3 -m venv /opt/infergate \
 && /opt/infergate/bin/pip install "torch==${TORCH_VERSION}" \
 && /opt/infergate/bin/pip install . \
 && find /opt/infergate -name '__pycache__' -prune -exec rm -rf {} +

FROM ${CUDA_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && (getent passwd 65532 || useradd --uid 65532 --user-group --no-create-home --home-dir /tmp nonroot)
COPY --from=build /opt/infergate /opt/infergate
ENV PATH=/opt/infergate/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
USER 65532:65532
EXPOSE 8000 5557
ENTRYPOINT ["infergate"]
CMD ["engine", "--help"]
