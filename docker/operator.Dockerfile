# syntax=docker/dockerfile:1.7
# The infergate operator: kopf + the kubernetes client, nothing of the engine (no torch).
#   docker build -f docker/operator.Dockerfile -t ghcr.io/infergate/operator:0.1.0 .
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY infergate infergate
COPY operator operator
COPY epp epp
COPY engine engine
RUN python -m venv /opt/infergate \
 && /opt/infergate/bin/pip install "kopf>=1.37" "kubernetes>=29" "pyyaml>=6" "typer>=0.12" "rich>=13" "pydantic>=2.6" \
 && /opt/infergate/bin/pip install --no-deps . \
 && find /opt/infergate -name '__pycache__' -prune -exec rm -rf {} +

FROM python:3.11-slim
COPY --from=build /opt/infergate /opt/infergate
ENV PATH=/opt/infergate/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
# 65532 is the conventional "nonroot" uid; the chart runs with a read-only root FS.
USER 65532:65532
ENTRYPOINT ["infergate"]
CMD ["operator", "--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz"]
