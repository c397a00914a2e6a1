"""The cluster driver: the suite against a real cluster (kind, via ``conformance/kind.sh``).

Expects the cluster in ``$KUBECONFIG`` to run a Gateway API implementation with
InferencePool support for the Gateways' class (kind.sh installs infergate's chart with its
Gateway controller; another implementation can be named with ``--gateway-class``) and
the suite's images to be loadable. At start it applies ``manifests/base.yaml`` and waits
for the model servers. A Gateway is reached through ``kubectl port-forward`` to its
Service (a kind cluster has no load balancer), so :meth:`gateway_address` is a loopback
address; the Service is the one its status address names, or the one labelled with the
Gateway's name.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

from conformance import topology as topo
from conformance.drivers.base import ENDPOINT_SLICES, Driver, Reply, Request, connect
from conformance.drivers.controlplane import send_http
from conformance.kube import KubeApi, wait_for
from infergate.procs import ProcessGroup, free_port, tcp_ready

GATEWAY_NAME_LABEL = "gateway.networking.k8s.io/gateway-name"


class ClusterDriver(Driver):
    name = "cluster"
    capabilities = frozenset({ENDPOINT_SLICES})
    settle_timeout = 300.0

    def __init__(self, workdir: Path, *, gateway_class: str = topo.DEFAULT_GATEWAY_CLASS) -> None:
        self.workdir = workdir
        self.kubectl = shutil.which("kubectl")
        if self.kubectl is None:
            raise RuntimeError("the cluster driver needs `kubectl` on PATH (for port-forward)")
        self.group = ProcessGroup()
        self._forwards: dict[tuple[str, str], str] = {}
        self._kube, self._http = connect(None, gateway_class)

    @property
    def kube(self) -> KubeApi:
        return self._kube

    def gateway_address(self, gateway: str, namespace: str) -> str:
        key = (namespace, gateway)
        if key not in self._forwards:
            self._forwards[key] = self._port_forward(gateway, namespace)
        return self._forwards[key]

    def _port_forward(self, gateway: str, namespace: str) -> str:
        """Forward the Gateway's Service (first listener's port) to loopback."""
        body = wait_for(
            lambda: self._kube.get("Gateway", namespace, gateway),
            timeout=self.settle_timeout, what=f"Gateway {gateway}",
        )  # fmt: skip
        port = int(body["spec"]["listeners"][0]["port"])
        addresses = {a.get("value") for a in (body.get("status") or {}).get("addresses") or []}
        services = wait_for(
            lambda: [s for s in self._kube.list("Service", namespace)
                     if (s.get("spec") or {}).get("clusterIP") in addresses
                     or (s["metadata"].get("labels") or {}).get(GATEWAY_NAME_LABEL) == gateway],
            timeout=self.settle_timeout, what=f"the Service of Gateway {gateway}",
        )  # fmt: skip
        service, local = services[0]["metadata"]["name"], free_port()
        print(f"[conformance] port-forward svc/{service} (Gateway {gateway}) -> 127.0.0.1:{local}")
        assert self.kubectl is not None
        self.group.start(
            f"port-forward-{gateway}",
            [self.kubectl, "port-forward", "-n", namespace, f"svc/{service}", f"{local}:{port}"],
            ready=tcp_ready("127.0.0.1", local), timeout=60.0,
        )  # fmt: skip
        return f"127.0.0.1:{local}"

    def send(self, address: str, request: Request) -> Reply:
        return send_http(self._http, address, request)

    def logs(self) -> Iterator[tuple[str, str]]:
        for process in self.group:
            yield process.name, process.log_tail(2000)

    def close(self) -> None:
        self._http.close()
        self.group.stop_all()
