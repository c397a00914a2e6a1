"""A small Kubernetes REST client for the suite: create, get, delete, status, waits.

Both drivers use it: locally against the KMock API-server emulator the operator runs
against, on kind against the real API server (through the same ``kubernetes`` client
configuration, so auth and TLS come from the kubeconfig).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

Obj = dict[str, Any]
T = TypeVar("T")


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None, name: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        return f"{base}/{name}" if name else base


KINDS: dict[str, Kind] = {
    "Namespace": Kind("", "v1", "namespaces", namespaced=False),
    "ConfigMap": Kind("", "v1", "configmaps"),
    "Service": Kind("", "v1", "services"),
    "Pod": Kind("", "v1", "pods"),
    "Deployment": Kind("apps", "v1", "deployments"),
    "NetworkPolicy": Kind("networking.k8s.io", "v1", "networkpolicies"),
    "InferencePool": Kind("inference.networking.k8s.io", "v1", "inferencepools"),
    "Gateway": Kind("gateway.networking.k8s.io", "v1", "gateways"),
    "HTTPRoute": Kind("gateway.networking.k8s.io", "v1", "httproutes"),
}

FIELD_MANAGER = "infergate-conformance"


class KubeError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        super().__init__(f"{method} {path} -> HTTP {status}: {body[:800]}")
        self.status = status
        self.body = body


def api_client_for(kubeconfig: str | None = None, context: str | None = None) -> Any:
    import kubernetes

    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(
        config_file=kubeconfig, context=context, client_configuration=configuration
    )
    return kubernetes.client.ApiClient(configuration)


class KubeApi:
    """Typed-by-kind REST calls (server-side apply for writes)."""

    def __init__(self, api_client: Any, timeout: float = 20.0) -> None:
        self.client = api_client
        self.timeout = timeout

    def call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str | None = None,
    ) -> Obj:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        _method, url, header_params, payload, post_params = self.client.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.client.call_api(
            _method,
            url,
            header_params=header_params,
            body=payload,
            post_params=post_params,
            _request_timeout=self.timeout,
        )
        data = response.read()
        text = data.decode() if isinstance(data, bytes) else str(data or "")
        if not 200 <= response.status < 300:
            raise KubeError(response.status, method, path, text)
        return json.loads(text) if text else {}

    def apply(self, obj: Obj) -> Obj:
        meta = obj["metadata"]
        return self.call(
            "PATCH",
            KINDS[obj["kind"]].path(meta.get("namespace"), meta["name"]),
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            body=obj,
            content_type="application/apply-patch+yaml",
        )

    def apply_all(self, objs: Iterable[Obj]) -> None:
        for obj in objs:
            self.apply(obj)

    def get(self, kind: str, namespace: str | None, name: str) -> Obj | None:
        try:
            return self.call("GET", KINDS[kind].path(namespace, name))
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    def list(
        self, kind: str, namespace: str | None, labels: dict[str, str] | None = None
    ) -> list[Obj]:
        query = []
        if labels:
            query.append(("labelSelector", ",".join(f"{k}={v}" for k, v in sorted(labels.items()))))
        items: list[Obj] = (
            self.call("GET", KINDS[kind].path(namespace), query=query).get("items") or []
        )
        return items

    def delete(self, kind: str, namespace: str | None, name: str) -> bool:
        try:
            self.call(
                "DELETE",
                KINDS[kind].path(namespace, name),
                body={
                    "apiVersion": "v1",
                    "kind": "DeleteOptions",
                    "propagationPolicy": "Background",
                },
            )
        except KubeError as error:
            if error.status == 404:
                return False
            raise
        return True

    def patch_status(self, kind: str, namespace: str, name: str, status: Obj) -> Obj:
        return self.call(
            "PATCH",
            KINDS[kind].path(namespace, name) + "/status",
            body={"status": status},
            content_type="application/merge-patch+json",
        )


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
