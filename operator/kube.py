"""A small typed client over the ``kubernetes`` package for the kinds the operator touches.

Server-side apply is a PATCH with ``application/apply-patch+yaml`` (JSON is YAML),
``fieldManager=infergate`` and ``force=true``: the operator is the single owner of what
it builds, so it takes fields back if someone else edited them.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from infergate.operator import constants as c

Obj = dict[str, Any]


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None, name: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        return f"{base}/{name}" if name else base


KINDS: dict[str, Kind] = {
    "ConfigMap": Kind("", "v1", "configmaps"),
    "Secret": Kind("", "v1", "secrets"),
    "ServiceAccount": Kind("", "v1", "serviceaccounts"),
    "Service": Kind("", "v1", "services"),
    "Pod": Kind("", "v1", "pods"),
    "Event": Kind("", "v1", "events"),
    "Role": Kind("rbac.authorization.k8s.io", "v1", "roles"),
    "RoleBinding": Kind("rbac.authorization.k8s.io", "v1", "rolebindings"),
    "Deployment": Kind("apps", "v1", "deployments"),
    "PodDisruptionBudget": Kind("policy", "v1", "poddisruptionbudgets"),
    c.POOL_KIND: Kind(c.POOL_GROUP, c.POOL_VERSION, c.POOL_PLURAL),
    "InferenceObjective": Kind(c.X_GROUP, c.X_VERSION, c.OBJECTIVE_PLURAL),
    "InferenceModelRewrite": Kind(c.X_GROUP, c.X_VERSION, c.REWRITE_PLURAL),
}

#: Kinds the operator creates per pool, in the order stale ones are pruned.
OWNED_KINDS = (
    "PodDisruptionBudget",
    "Service",
    "Deployment",
    "RoleBinding",
    "Role",
    "ServiceAccount",
    "ConfigMap",
)


class KubeError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        super().__init__(f"{method} {path} -> HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


class Kube:
    """The API calls the reconciler makes; one instance per operator process.

    ``kinds`` and ``field_manager`` are class attributes so another client (the
    conformance suite's) can reuse the calls with its own kinds and apply identity.
    """

    kinds: dict[str, Kind] = KINDS
    field_manager: str = c.FIELD_MANAGER

    def __init__(self, api_client: Any = None, timeout: float = 15.0) -> None:
        if api_client is None:
            api_client = new_api_client()
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
        serialized = self.client.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        _method, url, header_params, payload, post_params = serialized
        response = self.client.call_api(
            _method, url, header_params=header_params, body=payload,
            post_params=post_params, _request_timeout=self.timeout,
        )  # fmt: skip
        data = response.read()
        text = data.decode() if isinstance(data, bytes) else str(data or "")
        if not 200 <= response.status < 300:
            raise KubeError(response.status, method, path, text)
        return json.loads(text) if text else {}

    def get(self, kind: str, namespace: str | None, name: str) -> Obj | None:
        try:
            return self.call("GET", self.kinds[kind].path(namespace, name))
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    def list(
        self, kind: str, namespace: str | None, label_selector: dict[str, str] | None = None
    ) -> list[Obj]:
        query = []
        if label_selector:
            selector = ",".join(f"{k}={v}" for k, v in sorted(label_selector.items()))
            query.append(("labelSelector", selector))
        result = self.call("GET", self.kinds[kind].path(namespace), query=query)
        items: list[Obj] = result.get("items") or []
        return items

    def apply(self, obj: Obj) -> Obj:
        meta = obj["metadata"]
        return self.call(
            "PATCH",
            self.kinds[obj["kind"]].path(meta.get("namespace"), meta["name"]),
            query=[("fieldManager", self.field_manager), ("force", "true")],
            body=obj,
            content_type="application/apply-patch+yaml",
        )

    def delete(self, kind: str, namespace: str | None, name: str, uid: str | None = None) -> bool:
        """Delete (background propagation); with ``uid``, only that very object."""
        body: Obj = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self.call("DELETE", self.kinds[kind].path(namespace, name), body=body)
        except KubeError as error:
            if error.status in (404, 409):
                return False
            raise
        return True

    def patch_status(
        self, kind: str, namespace: str, name: str, status: Obj, resource_version: str = ""
    ) -> Obj:
        """Merge-patch the status subresource; with ``resource_version``, guarded by it
        (409 if stale)."""
        body: Obj = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        return self.call(
            "PATCH",
            self.kinds[kind].path(namespace, name) + "/status",
            body=body,
            content_type="application/merge-patch+json",
        )

    def event(self, involved: Obj, type_: str, reason: str, message: str) -> None:
        """Record a core/v1 Event about ``involved`` (best effort: never fails a resync)."""
        meta = involved.get("metadata") or {}
        namespace = meta.get("namespace") or "default"
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta.get('name')}.{uuid.uuid4().hex[:12]}",
                "namespace": namespace,
            },
            "involvedObject": {
                "apiVersion": involved.get("apiVersion"),
                "kind": involved.get("kind"),
                "name": meta.get("name"),
                "namespace": namespace,
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": "infergate-operator"},
            "reportingComponent": "infergate.io/operator",
            "reportingInstance": "infergate-operator",
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        with contextlib.suppress(KubeError):
            self.call("POST", self.kinds["Event"].path(namespace), body=event)


def new_api_client() -> Any:
    """An ApiClient from the in-cluster service account, else $KUBECONFIG / ~/.kube."""
    import kubernetes

    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        # The client reads $KUBECONFIG once, at import; read it now instead.
        path = os.environ.get("KUBECONFIG") or None
        if path and os.pathsep in path:
            path = None  # a list of files: let the client merge them
        kubernetes.config.load_kube_config(config_file=path, client_configuration=configuration)
    return kubernetes.client.ApiClient(configuration)
