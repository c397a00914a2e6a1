"""What the suite runs against, named once for both drivers: pools, pods and routes.

The pools, their echo Deployments and the EPP config are read from
``manifests/base.yaml``; the routes mirror ``manifests/gateway.yaml`` (GIE's HTTPRoutes):
on a cluster a route is a Gateway + hostname + path, locally an Envoy listener.
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
GATEWAY_MANIFEST = MANIFESTS / "gateway.yaml"
CRDS = HERE.parent / "crds"

APP_NS = "inference-conformance-app-backend"
INFRA_NS = "inference-conformance-infra"
PRIMARY_POOL = "primary-inference-pool"
SECONDARY_POOL = "secondary-inference-pool"
DP_POOL = "dp-inference-pool"
FALLBACK_POOL = "fallback-inference-pool"
PRIMARY_GATEWAY = "conformance-primary"
SECONDARY_GATEWAY = "conformance-secondary"
EPP_CONFIG_MAP = "conformance-epp-config"

#: GIE's conformance headers.
SELECTION_HEADER = "test-epp-endpoint-selection"
VERIFIER_HEADER = "x-conformance-test-served-endpoint"
SERVED_HEADER = "x-gateway-destination-endpoint-served"

#: GIE's conformance request body (any OpenAI-ish body works; the echo servers accept all).
REQUEST_BODY = {
    "model": "conformance-fake-model",
    "prompt": "Write as if you were a critic: San Francisco",
}

Obj = dict[str, Any]


@dataclass(frozen=True)
class Route:
    """An HTTPRoute of the suite: which Gateway, host and path reach which pools."""

    name: str
    gateway: str
    hostname: str
    path: str
    backends: tuple[tuple[str, int], ...]  # (pool name, weight)

    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(pool for pool, _ in self.backends)


ROUTES: dict[str, Route] = {
    "primary": Route(
        "httproute-for-primary-gw", PRIMARY_GATEWAY, "primary.example.com",
        "/primary-gateway-test", ((PRIMARY_POOL, 1),),
    ),
    "failopen": Route(
        "httproute-for-failopen-pool-gw", SECONDARY_GATEWAY, "secondary.example.com",
        "/failopen-pool-test", ((SECONDARY_POOL, 1),),
    ),
    "dp": Route(
        "httproute-for-primary-gw-dp", PRIMARY_GATEWAY, "primary.example.com",
        "/primary-gateway-dp-test", ((DP_POOL, 1),),
    ),
    "weighted": Route(
        "httproute-weighted-two-pools", PRIMARY_GATEWAY, "primary.example.com",
        "/weighted-two-pools-test", ((PRIMARY_POOL, 70), (SECONDARY_POOL, 30)),
    ),
    "fallback": Route(
        "httproute-for-fallback-pool", PRIMARY_GATEWAY, "primary.example.com",
        "/fallback-pool-test", ((FALLBACK_POOL, 1),),
    ),
}  # fmt: skip


@dataclass(frozen=True)
class PoolModel:
    """One InferencePool of base.yaml with the Deployment its selector matches."""

    name: str
    namespace: str
    app: str
    replicas: int
    target_ports: tuple[int, ...]
    failure_mode: str
    picker_service: str
    picker_port: int
    epp_config: str
    body: Obj = field(repr=False, compare=False)


def load_manifest(path: Path, **substitutions: str) -> list[Obj]:
    text = path.read_text()
    for key, value in substitutions.items():
        text = text.replace("{" + key + "}", value)
    return [doc for doc in yaml.safe_load_all(text) if doc]


@cache
def base_objects() -> tuple[Obj, ...]:
    return tuple(load_manifest(BASE_MANIFEST))


def epp_config_text(config_map: str = EPP_CONFIG_MAP) -> str:
    """The EndpointPickerConfig held by one of base.yaml's ConfigMaps."""
    for obj in base_objects():
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] == config_map:
            return str(obj["data"]["config.yaml"])
    raise LookupError(f"{BASE_MANIFEST} has no ConfigMap {config_map}")


@cache
def pools() -> dict[str, PoolModel]:
    deployments = {
        tuple(sorted(d["spec"]["selector"]["matchLabels"].items())): d
        for d in base_objects()
        if d["kind"] == "Deployment"
    }
    found: dict[str, PoolModel] = {}
    for obj in base_objects():
        if obj["kind"] != "InferencePool":
            continue
        spec = obj["spec"]
        labels = spec["selector"]["matchLabels"]
        deployment = deployments[tuple(sorted(labels.items()))]
        ref = spec["endpointPickerRef"]
        found[obj["metadata"]["name"]] = PoolModel(
            name=obj["metadata"]["name"],
            namespace=obj["metadata"]["namespace"],
            app=labels["app"],
            replicas=int(deployment["spec"]["replicas"]),
            target_ports=tuple(int(p["number"]) for p in spec["targetPorts"]),
            failure_mode=ref.get("failureMode", "FailClose"),
            picker_service=ref["name"],
            picker_port=int(ref["port"]["number"]),
            epp_config=obj["metadata"]["annotations"]["infergate.io/epp-config"],
            body=obj,
        )
    return found
