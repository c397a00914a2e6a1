# syntax=docker/dockerfile:1.7
# The engine for CPU (tests, demos, the chart's tiny sample): torch from the CPU index.
#   docker build -f docker/engine.Dockerfile -t ghcr.io/infergate/engine:0.1.0 .
FROM python:3.11-slim AS build
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY infergate infergate
COPY operator operator
COPY epp epp
COPY engine engine
RUN python -m venv /opt/infergate \
 && /opt/infergate/bin/pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu \
 && /opt/infergate/bin/pip install . \
 && find /opt/infergate -name '__pycache__' -prune -exec rm -rf {} +

FROM python:3.11-slim
COPY --from=build /opt/infergate /opt/infergate
ENV PATH=/opt/infergate/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["infergate"]
CMD ["engine", "--help"]
