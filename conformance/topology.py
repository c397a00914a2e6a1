"""What the suite runs against, named once for every driver and test: GIE's namespaces,
Gateways, pools and headers, read from ``manifests/base.yaml``, and each test's own
manifests (``manifests/tests/<test>.yaml``: its HTTPRoutes, sometimes a pool).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
MANIFESTS = HERE / "manifests"
BASE_MANIFEST = MANIFESTS / "base.yaml"
TEST_MANIFESTS = MANIFESTS / "tests"
CRDS = HERE.parent / "crds"

#: The GatewayClass the suite's Gateways name unless the driver is told otherwise.
DEFAULT_GATEWAY_CLASS = "infergate"

APP_NS = "inference-conformance-app-backend"
INFRA_NS = "inference-conformance-infra"
PRIMARY_GATEWAY = "conformance-primary"
SECONDARY_GATEWAY = "conformance-secondary"
PRIMARY_POOL = "primary-inference-pool"
SECONDARY_POOL = "secondary-inference-pool"
DP_POOL = "dp-inference-pool"
FALLBACK_POOL = "fallback-inference-pool"
APPPROTOCOL_HTTP_POOL = "appprotocol-http-inference-pool"
APPPROTOCOL_H2C_POOL = "appprotocol-h2c-inference-pool"
PRIMARY_APP = "primary-inference-model-server"
SECONDARY_APP = "secondary-inference-model-server"
APPPROTOCOL_APP = "appprotocol-inference-model-server"
DP_APP = "dp-inference-model-server"
PRIMARY_DEPLOYMENT = "primary-inference-model-server-deployment"
MODEL_SERVER_REPLICAS = 3

#: GIE's conformance headers.
SELECTION_HEADER = "test-epp-endpoint-selection"
VERIFIER_HEADER = "x-conformance-test-served-endpoint"
#: infergate's EPP names the endpoint that served on the response.
SERVED_HEADER = "x-gateway-destination-endpoint-served"

#: GIE's conformance request body.
REQUEST_BODY = {
    "model": "conformance-fake-model",
    "prompt": "Write as if you were a critic: San Francisco",
}

Obj = dict[str, Any]


@dataclass(frozen=True)
class PoolModel:
    """One InferencePool of base.yaml and the Service of its Endpoint Picker."""

    name: str
    namespace: str
    app: str
    target_ports: tuple[int, ...]
    failure_mode: str
    picker_service: str
    body: Obj = field(repr=False, compare=False)


def load_manifest(path: Path, **substitutions: str) -> list[Obj]:
    """The documents of a YAML file, ``{KEY}`` placeholders replaced."""
    text = path.read_text()
    for key, value in substitutions.items():
        text = text.replace("{" + key + "}", value)
    return [doc for doc in yaml.safe_load_all(text) if doc]


@cache
def base_objects(gateway_class: str = DEFAULT_GATEWAY_CLASS) -> tuple[Obj, ...]:
    return tuple(load_manifest(BASE_MANIFEST, GATEWAY_CLASS_NAME=gateway_class))


def manifest_of(name: str) -> list[Obj]:
    """The objects one test applies (``manifests/tests/<name>.yaml``)."""
    return load_manifest(TEST_MANIFESTS / f"{name}.yaml")


@cache
def pools() -> dict[str, PoolModel]:
    found: dict[str, PoolModel] = {}
    for obj in base_objects():
        if obj["kind"] != "InferencePool":
            continue
        spec = obj["spec"]
        ref = spec["endpointPickerRef"]
        found[obj["metadata"]["name"]] = PoolModel(
            name=obj["metadata"]["name"],
            namespace=obj["metadata"]["namespace"],
            app=spec["selector"]["matchLabels"]["app"],
            target_ports=tuple(int(p["number"]) for p in spec["targetPorts"]),
            failure_mode=ref.get("failureMode", "FailClose"),
            picker_service=ref["name"],
            body=obj,
        )
    return found
