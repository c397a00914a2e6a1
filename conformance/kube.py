"""A small Kubernetes REST client for the suite: create, get, delete, status, waits.

Both drivers use it, each against a real API server: the control plane on loopback, or
kind's (through the same ``kubernetes`` client configuration, so auth and TLS come from
the kubeconfig).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from infergate.operator.kube import KINDS as OPERATOR_KINDS
from infergate.operator.kube import Kind, Kube, KubeError, Obj

__all__ = ["KINDS", "Kind", "KubeApi", "KubeError", "api_client_for", "wait_for"]

T = TypeVar("T")


KINDS: dict[str, Kind] = {
    **OPERATOR_KINDS,
    "Namespace": Kind("", "v1", "namespaces", namespaced=False),
    "NetworkPolicy": Kind("networking.k8s.io", "v1", "networkpolicies"),
    "Gateway": Kind("gateway.networking.k8s.io", "v1", "gateways"),
    "HTTPRoute": Kind("gateway.networking.k8s.io", "v1", "httproutes"),
    "GatewayClass": Kind("gateway.networking.k8s.io", "v1", "gatewayclasses", namespaced=False),
    "EndpointSlice": Kind("discovery.k8s.io", "v1", "endpointslices"),
}


def api_client_for(kubeconfig: str | None = None, context: str | None = None) -> Any:
    import kubernetes

    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(
        config_file=kubeconfig, context=context, client_configuration=configuration
    )
    return kubernetes.client.ApiClient(configuration)


class KubeApi(Kube):
    """The operator's client with the suite's kinds and its own apply identity."""

    kinds = KINDS
    field_manager = "infergate-conformance"

    def __init__(self, api_client: Any, timeout: float = 20.0) -> None:
        super().__init__(api_client, timeout)

    def apply_all(self, objs: Iterable[Obj]) -> None:
        for obj in objs:
            self.apply(obj)


def wait_for(
    probe: Callable[[], T | None], *, timeout: float, what: str, interval: float = 0.25
) -> T:
    """Poll ``probe`` until it returns something truthy; AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}"
            )
        time.sleep(interval)


def parent_entries(pool: Obj | None) -> list[Obj]:
    return list(((pool or {}).get("status") or {}).get("parents") or [])


def conditions_of(entry: Obj) -> dict[str, Obj]:
    return {c["type"]: c for c in entry.get("conditions") or []}
