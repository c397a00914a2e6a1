"""The control-plane driver: infergate as the Gateway API implementation, on the real
control plane the cluster tier builds, with processes standing in for containers.

* **The API server** is the real one (:class:`tests.support.controlplane.ControlPlane`:
  etcd, kube-apiserver with RBAC, controller-manager, scheduler, kwok).
* **infergate** is installed with the real ``helm`` (``charts/infergate``: CRDs, the
  Gateway API CRDs, GatewayClass ``infergate``, RBAC) and its operator runs from this
  checkout as a process whose only credential is a TokenRequest token of the chart's
  ServiceAccount, its xDS server on a free loopback port. It is the GatewayClass
  controller: each Gateway becomes an Envoy Deployment, Service and bootstrap ConfigMap,
  and the operator serves that Envoy its listeners, routes and clusters over xDS.
* **Pods** are made by the real deployment and replicaset controllers; kwok runs them on
  loopback IPs and :class:`conformance.drivers.runtime.PodRuntime` runs their containers:
  echo model servers, the suite's Endpoint Pickers (``infergate epp``, as GIE deploys its
  reference EPP) and each Gateway's Envoy on the operator's bootstrap.
* **Gateway addresses**: the operator reports the Gateway Service's ClusterIP; nothing
  here plays kube-proxy, so :meth:`gateway_address` does its job for that one
  connection: ClusterIP:port → a ready pod the Service selects, ``podIP:targetPort``.
  (From the selector: the API server refuses loopback addresses in Endpoints and
  EndpointSlices, so the endpointslice controller's slices stay empty here.)
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from conformance import topology as topo
from conformance.drivers.base import STOP_PODS, Driver, Pod, Reply, Request
from conformance.drivers.runtime import PodRuntime
from conformance.kube import KubeApi, api_client_for, wait_for
from infergate.procs import ProcessGroup, free_port, http_ready, tcp_ready
from tests.support.controlplane import Cluster, ControlPlane

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_NS = "infergate-system"
RELEASE = "infergate"  # the chart's fullname is then "infergate"
#: The chart as the suite installs it: no kopf peering (one operator process), the
#: Gateway controller on, Endpoint Pickers left to the suite (as GIE deploys its own).
HELM_VALUES = (
    "operator.peering=",
    "gateway.enabled=true",
    "gateway.serviceType=ClusterIP",
    "operator.manageEndpointPickers=false",
)
#: What the chart tells the operator its Gateways' Envoys dial for xDS (its xDS Service);
#: the pod runtime points that at the operator process, as cluster DNS would.
XDS_SERVICE = f"{RELEASE}-xds.{OPERATOR_NS}.svc"
#: How the operator process runs: Gateway Services are ClusterIP (no load balancer here),
#: and it deploys no Endpoint Picker of its own (GIE's suite brings them).
OPERATOR_FLAGS = ("--gateway-service-type", "ClusterIP", "--no-manage-endpoint-pickers")


class ControlPlaneDriver(Driver):
    name = "controlplane"
    capabilities = frozenset({STOP_PODS})
    settle_timeout = 120.0

    def __init__(
        self,
        workdir: Path,
        cli: Sequence[str],
        bin_dir: Path,
        gateway_class: str,
        *,
        objects: Sequence[topo.Obj] | None = None,
        namespaces: Sequence[str] = (topo.APP_NS, topo.INFRA_NS),
    ) -> None:
        """``objects`` (default: the suite's base.yaml) are applied once the operator and
        the pod runtime run; the runtime serves pods in ``namespaces``. Both can be
        changed so the route-change benchmark brings up only its own small topology."""
        self.workdir = workdir
        self.cli = list(cli)
        self.objects = (
            list(objects) if objects is not None else list(topo.base_objects(gateway_class))
        )
        self.namespaces = tuple(namespaces)
        self.group = ProcessGroup()
        self._http = httpx.Client(timeout=30.0)
        self.plane = ControlPlane(bin_dir=bin_dir, workdir=workdir / "plane").start()
        try:
            self._start(bin_dir)
        except BaseException:
            self.close()
            raise

    def _start(self, bin_dir: Path) -> None:
        plane = self.plane
        self.cluster = Cluster(
            kubeconfig=plane.admin_kubeconfig, bin_dir=bin_dir, workdir=self.workdir
        )
        sets = [arg for value in HELM_VALUES for arg in ("--set", value)]
        self.cluster.helm(
            "install", RELEASE, str(ROOT / "charts" / "infergate"), "-n", OPERATOR_NS,
            "--create-namespace", *sets,
        )  # fmt: skip
        self._kube = KubeApi(api_client_for(str(plane.admin_kubeconfig)))
        xds_port = free_port()
        self._start_operator(xds_port)
        self.runtime = PodRuntime(
            self._kube, self.cluster, self.workdir / "pods",
            namespaces=self.namespaces, cli=self.cli, xds=("127.0.0.1", xds_port),
        ).start()  # fmt: skip
        self._kube.apply_all(self.objects)

    def _start_operator(self, xds_port: int) -> None:
        """The operator on the chart's ServiceAccount token, xDS on ``xds_port``."""
        kubeconfig = self.cluster.service_account_kubeconfig(OPERATOR_NS, RELEASE)
        liveness = free_port()
        self.group.start(
            "operator",
            [*self.cli, "operator", "--xds-port", str(xds_port),
             "--xds-listen-address", "127.0.0.1", "--xds-address", XDS_SERVICE,
             *OPERATOR_FLAGS, "--standalone",
             "--liveness", f"http://127.0.0.1:{liveness}/healthz"],
            ready=http_ready(f"http://127.0.0.1:{liveness}/healthz"), timeout=120.0,
            env=dict(os.environ, KUBECONFIG=str(kubeconfig), INFERGATE_RESYNC_SECONDS="2"),
        )  # fmt: skip
        wait_for(tcp_ready("127.0.0.1", xds_port), timeout=60.0, what="the operator's xDS port")

    @property
    def kube(self) -> KubeApi:
        return self._kube

    def gateway_address(self, gateway: str, namespace: str) -> str:
        """The address in the Gateway's status; a ClusterIP is taken to a ready endpoint
        of its Service (the kube-proxy substitution, see the module docstring)."""
        body, address = wait_for(
            lambda: _status_address(self._kube.get("Gateway", namespace, gateway)),
            timeout=self.settle_timeout, what=f"an address in Gateway {gateway}'s status",
        )  # fmt: skip
        port = int(body["spec"]["listeners"][0]["port"])
        target = wait_for(
            lambda: self._behind_cluster_ip(namespace, address, port),
            timeout=self.settle_timeout, what=f"a ready endpoint behind {address}:{port}",
        )  # fmt: skip
        return target

    def _behind_cluster_ip(self, namespace: str, address: str, port: int) -> str | None:
        """``podIP:targetPort`` of a ready pod the Service selects, for ClusterIP:port.
        From the selector, not the EndpointSlices: the API server refuses loopback
        addresses in endpoints, so here the endpointslice controller's slices stay empty."""
        services = self._kube.list("Service", namespace)
        service = next((s for s in services if s["spec"].get("clusterIP") == address), None)
        if service is None:
            return _join(address, port)  # not a ClusterIP: dial it as it is
        service_port = next(
            (p for p in service["spec"].get("ports") or [] if p.get("port") == port), None
        )
        if service_port is None:
            return None
        for pod in selected_pods(self._kube, namespace, service["spec"].get("selector") or {}):
            target = _target_port(pod, service_port.get("targetPort", port))
            if target:
                return _join(pod["status"]["podIP"], target)
        return None

    def send(self, address: str, request: Request) -> Reply:
        return send_http(self._http, address, request)

    @contextlib.contextmanager
    def pod_stopped(self, pod: Pod) -> Iterator[None]:
        self.runtime.hold(topo.APP_NS, pod.name)
        try:
            yield
        finally:
            self.runtime.release(topo.APP_NS, pod.name)

    def logs(self) -> Iterator[tuple[str, str]]:
        for process in self.group:
            yield process.name, process.log_tail(3000)
        if hasattr(self, "runtime"):
            yield from self.runtime.logs()

    def close(self) -> None:
        try:
            self._http.close()
            if hasattr(self, "runtime"):
                self.runtime.close()
            self.group.stop_all()
        finally:
            self.plane.stop()


def _status_address(gateway: dict[str, Any] | None) -> tuple[dict[str, Any], str] | None:
    """GIE's rule: the first status address that has a type."""
    for address in ((gateway or {}).get("status") or {}).get("addresses") or []:
        if address.get("type") and address.get("value"):
            return gateway or {}, str(address["value"])
    return None


def selected_pods(kube: KubeApi, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
    """Running, ready, not deleting pods a Service selector picks, by name (what the
    endpoints controllers would list)."""
    if not selector:
        return []
    pods = []
    for pod in kube.list("Pod", namespace, selector):
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        if status.get("podIP") and ready and not pod["metadata"].get("deletionTimestamp"):
            pods.append(pod)
    return sorted(pods, key=lambda p: str(p["metadata"]["name"]))


def _target_port(pod: dict[str, Any], target: Any) -> int | None:
    if isinstance(target, int) or (isinstance(target, str) and target.isdigit()):
        return int(target)
    for container in pod["spec"].get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == target:
                return int(port["containerPort"])
    return None


def _join(host: str, port: int) -> str:
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    return f"{host}:{port}"


def send_http(client: httpx.Client, address: str, request: Request) -> Reply:
    """One request as GIE's round tripper makes it: the Host header is the request's
    host (else the address), and ``X-Echo-Set-Header`` is always sent (empty here)."""
    headers = {"X-Echo-Set-Header": "", **request.headers}
    if request.host:
        headers["Host"] = request.host
    url = f"http://{address}{request.path}"
    if request.body is None:
        response = client.request(request.method, url, headers=headers)
    else:
        response = client.request(request.method, url, headers=headers, json=request.body)
    return Reply.build(response.status_code, response.headers, response.content)
