# syntax=docker/dockerfile:1.7
# The engine for NVIDIA GPUs: PyPI's torch wheels, which bundle the CUDA runtime, cuBLAS,
# cuDNN and NCCL as nvidia-* wheels; the driver (libcuda) comes from the node through the
# NVIDIA container toolkit, so no CUDA base image is needed.
#   docker build -f docker/engine-cuda.Dockerfile -t ghcr.io/infergate/engine:0.1.0-cuda .
#   make images IMAGES=engine-cuda     (the same file, no Docker daemon: docs/images.md)
# Nothing compiles kernels at run time: the engine's only attention backend is torch's SDPA.
# Not run on a GPU in this repository's CI.
# Debian's python3 on debian:bookworm-slim, PyPI wheels in a venv. Layers, bottom up: the
# base, python3 (apt), the dependencies with torch (change rarely), infergate itself.
ARG DEBIAN_IMAGE=debian:bookworm-slim

FROM ${DEBIAN_IMAGE} AS runtime
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log \
 && useradd --uid 65532 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin nonroot

# pip's cache stays in this stage, which the image does not keep. PIP_CERT: a CA bundle
# for pip when the build machine is behind a TLS-intercepting proxy (tools/images/build.sh
# mounts the host's, for the build only); unset, pip trusts Debian's bundle.
FROM runtime AS deps
ARG PIP_CERT
ARG DEBIAN_FRONTEND=noninteractive
ARG TORCH_VERSION=2.13.0
# PyPI's torch: the CUDA build.
ARG TORCH_INDEX_URL=https://pypi.org/simple
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update && apt-get install -y --no-install-recommends python3-venv
RUN python3 -m venv /opt/infergate \
 && /opt/infergate/bin/pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
COPY pyproject.toml /src/
RUN python3 -c 'import tomllib; print("\n".join(tomllib.load(open("/src/pyproject.toml", "rb"))["project"]["dependencies"]))' > /tmp/requirements.txt \
 && /opt/infergate/bin/pip install -r /tmp/requirements.txt \
 && find /opt/infergate -name '__pycache__' -prune -exec rm -rf {} +

FROM deps AS app
ARG PIP_CERT
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY infergate infergate
COPY operator operator
COPY epp epp
COPY engine engine
RUN /opt/infergate/bin/pip install --no-deps --root /app . \
 && find /app -name '__pycache__' -prune -exec rm -rf {} +

FROM runtime
COPY --from=deps /opt/infergate /opt/infergate
COPY --from=app /app/opt/infergate /opt/infergate
ENV PATH=/opt/infergate/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
# Ask the NVIDIA container toolkit for the CUDA driver libraries (its default has varied).
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 65532:65532
EXPOSE 8000 5557
ENTRYPOINT ["infergate"]
CMD ["engine", "--help"]
