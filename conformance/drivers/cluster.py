"""The cluster driver: the suite against a real cluster (kind, via ``conformance/kind.sh``).

Expects the cluster in ``$KUBECONFIG`` to have the infergate chart (CRDs + operator)
and a Gateway API implementation with InferencePool support (kind.sh installs Istio),
and the echo image loadable. At start it applies ``manifests/base.yaml`` and
``manifests/gateway.yaml`` (server-side apply), waits for the echo pods, the EPP
Deployments the operator creates and the Gateways, and port-forwards each Gateway's
Service to loopback (``kubectl port-forward``), so no LoadBalancer is needed.

An EPP is made unavailable as GIE's suite does it, by cutting it off the network rather
than by editing objects the operator owns (it would put them back): a NetworkPolicy
denies all ingress to the pool's EPP pods, and the pods are restarted so no connection
opened before the policy survives it.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from conformance import topology as topo
from conformance.drivers.base import GATEWAY_API, Driver, Pod, Reply
from conformance.kube import KubeApi, api_client_for, wait_for
from infergate.procs import ProcessGroup, free_port, tcp_ready

#: Labels the operator puts on a pool's EPP pods (infergate.operator.builders).
EPP_POD_LABELS = {"app.kubernetes.io/name": "infergate-epp"}
GATEWAY_NAME_LABEL = "gateway.networking.k8s.io/gateway-name"


def _pod_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def _available(deployment: dict[str, Any] | None) -> bool:
    if not deployment:
        return False
    status = deployment.get("status") or {}
    return int(status.get("availableReplicas") or 0) >= 1 and int(
        status.get("observedGeneration") or 0
    ) >= int(deployment["metadata"].get("generation") or 0)


class ClusterDriver(Driver):
    name = "cluster"
    capabilities = frozenset({GATEWAY_API})
    settle_timeout = 180.0

    def __init__(self, workdir: Path, *, gateway_class: str = "istio") -> None:
        self.workdir = workdir
        self.kubectl = shutil.which("kubectl")
        if self.kubectl is None:
            raise RuntimeError("the cluster driver needs `kubectl` on PATH (for port-forward)")
        self.group = ProcessGroup()
        self._kube = KubeApi(api_client_for())
        self._http = httpx.Client(timeout=30.0)
        self._gateway_ports: dict[str, int] = {}
        print(f"[conformance] applying {topo.BASE_MANIFEST.name} and {topo.GATEWAY_MANIFEST.name}")
        self._kube.apply_all(topo.base_objects())
        self._kube.apply_all(
            topo.load_manifest(topo.GATEWAY_MANIFEST, GATEWAY_CLASS_NAME=gateway_class)
        )
        for pool in topo.pools().values():
            print(f"[conformance] waiting for {pool.replicas} ready pods of {pool.name}")
            self._wait_pods(pool)
            print(f"[conformance] waiting for the Endpoint Picker of {pool.name}")
            self.picker_available(pool.name)
        for gateway in (topo.PRIMARY_GATEWAY, topo.SECONDARY_GATEWAY):
            self._port_forward(gateway)

    @property
    def kube(self) -> KubeApi:
        return self._kube

    def _wait_pods(self, pool: topo.PoolModel) -> None:
        def enough() -> bool:
            return len(self.pods(pool.name)) == pool.replicas

        wait_for(
            enough, timeout=self.settle_timeout, what=f"{pool.replicas} ready pods of {pool.name}"
        )

    def pods(self, pool: str) -> list[Pod]:
        model = topo.pools()[pool]
        found = [
            Pod(p["metadata"]["name"], p["status"]["podIP"], model.target_ports)
            for p in self._kube.list("Pod", model.namespace, {"app": model.app})
            if _pod_ready(p) and not p["metadata"].get("deletionTimestamp")
        ]
        return sorted(found, key=lambda pod: pod.name)

    def picker_available(self, pool: str) -> None:
        model = topo.pools()[pool]
        wait_for(
            lambda: _available(self._kube.get("Deployment", model.namespace, model.picker_service)),
            timeout=self.settle_timeout, what=f"Deployment {model.picker_service} available",
        )  # fmt: skip

    def _port_forward(self, gateway: str) -> None:
        """Forward the Service the Gateway implementation made for ``gateway`` to loopback."""
        services = wait_for(
            lambda: self._kube.list("Service", topo.INFRA_NS, {GATEWAY_NAME_LABEL: gateway}),
            timeout=self.settle_timeout, what=f"the Service of Gateway {gateway}",
        )  # fmt: skip
        service = services[0]["metadata"]["name"]
        port = free_port()
        print(f"[conformance] port-forward svc/{service} (Gateway {gateway}) -> 127.0.0.1:{port}")
        assert self.kubectl is not None
        self.group.start(
            f"port-forward-{gateway}",
            [self.kubectl, "port-forward", "-n", topo.INFRA_NS, f"svc/{service}", f"{port}:80"],
            ready=tcp_ready("127.0.0.1", port), timeout=60.0,
        )  # fmt: skip
        self._gateway_ports[gateway] = port

    def send_to_gateway(
        self,
        gateway: str,
        hostname: str,
        path: str,
        *,
        headers: Mapping[str, str] | None = None,
        body: Any = None,
        method: str = "POST",
    ) -> Reply:
        url = f"http://127.0.0.1:{self._gateway_ports[gateway]}{path}"
        request_headers = {"host": hostname, **(headers or {})}
        if method in ("GET", "HEAD", "DELETE"):
            response = self._http.request(method, url, headers=request_headers)
        else:
            response = self._http.request(
                method,
                url,
                headers=request_headers,
                json=topo.REQUEST_BODY if body is None else body,
            )
        return Reply.build(response.status_code, response.headers, response.content)

    def send(
        self,
        route: str,
        *,
        headers: Mapping[str, str] | None = None,
        body: Any = None,
        method: str = "POST",
    ) -> Reply:
        spec = topo.ROUTES[route]
        return self.send_to_gateway(
            spec.gateway, spec.hostname, spec.path, headers=headers, body=body, method=method
        )

    @contextlib.contextmanager
    def epp_unavailable(self, pool: str) -> Iterator[None]:
        model = topo.pools()[pool]
        labels = {**EPP_POD_LABELS, "app.kubernetes.io/instance": pool}
        name = f"conformance-isolate-{pool}"
        print(f"[conformance] cutting the Endpoint Picker of {pool} off the network")
        self._kube.apply(
            {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
             "metadata": {"name": name, "namespace": model.namespace},
             "spec": {"podSelector": {"matchLabels": labels}, "policyTypes": ["Ingress"], "ingress": []}}
        )  # fmt: skip
        for pod in self._kube.list("Pod", model.namespace, labels):
            self._kube.delete("Pod", model.namespace, pod["metadata"]["name"])
        try:
            yield
        finally:
            print(f"[conformance] reconnecting the Endpoint Picker of {pool}")
            self._kube.delete("NetworkPolicy", model.namespace, name)
            self.picker_available(pool)

    def logs(self) -> Iterator[tuple[str, str]]:
        for process in self.group:
            yield process.name, process.log_tail(2000)

    def close(self) -> None:
        self._http.close()
        self.group.stop_all()
