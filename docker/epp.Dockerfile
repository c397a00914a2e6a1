# syntax=docker/dockerfile:1.7
# The Endpoint Picker: every runtime dependency except the engine's (engine_only below; xgrammar
# is one because it requires torch; tokenizers is kept, the precise-prefix scorer's
# tokenizerPath loads it). tests/epp/test_epp_imports.py checks the list.
#   docker build -f docker/epp.Dockerfile -t ghcr.io/infergate/epp:0.1.0 .
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY infergate infergate
COPY operator operator
COPY epp epp
COPY engine engine
RUN python - > /tmp/requirements.txt <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
engine_only = {"torch", "safetensors", "jinja2", "xgrammar"}
print("\n".join(d for d in deps if re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0] not in engine_only))
PY
RUN python -m venv /opt/infergate \
 && /opt/infergate/bin/pip install -r /tmp/requirements.txt \
 && /opt/infergate/bin/pip install --no-deps . \
 && find /opt/infergate -name '__pycache__' -prune -exec rm -rf {} +

FROM python:3.11-slim
COPY --from=build /opt/infergate /opt/infergate
ENV PATH=/opt/infergate/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
USER 65532:65532
EXPOSE 9002 9003 9090
ENTRYPOINT ["infergate"]
CMD ["epp", "--help"]
