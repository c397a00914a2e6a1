# syntax=docker/dockerfile:1.7
# The Endpoint Picker: every runtime dependency except the engine's (engine_only below; xgrammar
# is one because it requires torch; tokenizers is kept, the precise-prefix scorer's
# tokenizerPath loads it). tests/epp/test_epp_imports.py checks the list.
#   docker build -f docker/epp.Dockerfile -t ghcr.io/infergate/epp:0.1.0 .
#   make images IMAGES=epp     (the same file, no Docker daemon: docs/images.md)
# Debian's python3 on debian:bookworm-slim, PyPI wheels in a venv. Layers, bottom up: the
# base, python3 (apt), the dependencies (change rarely), infergate itself (every commit).
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
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update && apt-get install -y --no-install-recommends python3-venv
COPY pyproject.toml /src/
RUN python3 -c 'import re, tomllib; deps = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]["dependencies"]; engine_only = {"torch", "safetensors", "jinja2", "xgrammar"}; print("\n".join(d for d in deps if re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0] not in engine_only))' > /tmp/requirements.txt \
 && python3 -m venv /opt/infergate \
 && /opt/infergate/bin/pip install -r /tmp/requirements.txt \
 && find /opt/infergate -name '__pycache__' -prune -exec rm -rf {} +

FROM deps AS app
ARG PIP_CERT
ARG DEBIAN_FRONTEND=noninteractive
# cargo for the native modules (native/grpc_h2, native/prefix_index); Debian's rustc-web is recent enough
# (bookworm's rustc is not). Only this stage has it; the image keeps the built module.
RUN apt-get update && apt-get install -y --no-install-recommends cargo-web rustc-web gcc libc6-dev
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY infergate infergate
COPY operator operator
COPY epp epp
COPY engine engine
COPY native native
RUN /opt/infergate/bin/pip install --no-deps --root /app . \
 && find /app -name '__pycache__' -prune -exec rm -rf {} +

FROM runtime
COPY --from=deps /opt/infergate /opt/infergate
COPY --from=app /app/opt/infergate /opt/infergate
ENV PATH=/opt/infergate/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
USER 65532:65532
EXPOSE 9002 9003 9090
ENTRYPOINT ["infergate"]
CMD ["epp", "--help"]
