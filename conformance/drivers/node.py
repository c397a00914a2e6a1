"""The node driver: the suite on the real node (``tools/node/probe.sh up``), pods as
containers from images.

``tools/node/conformance.sh`` (``sudo make conformance-node``) brings the node up (the
control plane, containerd, runc, CNI, kubelet, kube-proxy, CoreDNS), imports the images
(``make images``' EPP as ``ghcr.io/infergate/epp:conformance``, the operator, the echo
server built on the EPP image, the node's Envoy), ``helm install``s the chart as
``conformance/kind.sh`` does, and runs pytest *inside the node's network namespace*, where
the API server, ClusterIPs and pod IPs route. What the process runner stands in for is
real here:

* the echo model servers and the suite's EPPs are pods the kubelet runs from their
  images, with their probes; each Gateway's Envoy is the operator's Deployment;
* Services are kube-proxy's, so :meth:`gateway_address` is GIE's ``GetGatewayEndpoint``
  as it is: the Gateway's status address (its Service's ClusterIP) and listener port;
* EndpointSlices are the endpointslice controller's, from real pod IPs: a picker Service
  that selects nothing has empty slices, and they fill again when it selects its pods.

:meth:`pod_stopped` makes one pod's model server refuse connections behind the API's back:
a ``REJECT`` rule in the pod's own network namespace (found through its container's pid),
removed after the block.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

from conformance import topology as topo
from conformance.drivers.base import (
    ENDPOINT_SLICES,
    STOP_PODS,
    Driver,
    Pod,
    Reply,
    Request,
    connect,
)
from conformance.drivers.controlplane import _join, _status_address, send_http
from conformance.kube import KubeApi, wait_for

WORKDIR = Path(os.environ.get("INFERGATE_NODE_WORKDIR", "/var/tmp/infergate-node"))


def node_env(workdir: Path = WORKDIR) -> dict[str, str]:
    """What ``probe.sh up`` wrote (``node.env``); a clear error when no node is up."""
    path = workdir / "node.env"
    if not path.is_file():
        raise RuntimeError(
            f"no node is up ({path} is missing): the node driver runs under "
            "tools/node/conformance.sh (`sudo make conformance-node`)"
        )
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {key: value for key, value in pairs}


def _in_node_namespace(netns: str) -> bool:
    """Whether this process runs in the node's network namespace (same inode)."""
    try:
        return os.stat(netns).st_ino == os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return False


class NodeDriver(Driver):
    name = "node"
    capabilities = frozenset({STOP_PODS, ENDPOINT_SLICES})
    settle_timeout = 300.0

    def __init__(self, workdir: Path, *, gateway_class: str = topo.DEFAULT_GATEWAY_CLASS) -> None:
        self.workdir = workdir
        self.env = node_env()
        if not _in_node_namespace(self.env["NETNS"]):
            raise RuntimeError(
                f"the node driver must run inside {self.env['NETNS']} (ClusterIPs and pod IPs "
                "route only there): use tools/node/conformance.sh"
            )
        self._kube, self._http = connect(self.env["KUBECONFIG"], gateway_class)

    @property
    def kube(self) -> KubeApi:
        return self._kube

    def gateway_address(self, gateway: str, namespace: str) -> str:
        """The Gateway's status address and first listener's port, once it accepts
        connections (kube-proxy syncs the Service's rules on its own schedule)."""
        body, address = wait_for(
            lambda: _status_address(self._kube.get("Gateway", namespace, gateway)),
            timeout=self.settle_timeout, what=f"an address in Gateway {gateway}'s status",
        )  # fmt: skip
        port = int(body["spec"]["listeners"][0]["port"])
        wait_for(
            lambda: _connects(address, port),
            timeout=self.settle_timeout, what=f"a connection to {address}:{port}",
        )  # fmt: skip
        return _join(address, port)

    def send(self, address: str, request: Request) -> Reply:
        return send_http(self._http, address, request)

    @contextlib.contextmanager
    def pod_stopped(self, pod: Pod) -> Iterator[None]:
        rule = ["INPUT", "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"]
        netns = f"/proc/{self._container_pid(topo.APP_NS, pod.name)}/ns/net"
        _iptables(netns, "-I", *rule)
        try:
            yield
        finally:
            _iptables(netns, "-D", *rule)

    def _container_pid(self, namespace: str, name: str) -> int:
        """The host pid of the pod's first container (runc's state of it)."""
        body = self._kube.get("Pod", namespace, name)
        statuses = ((body or {}).get("status") or {}).get("containerStatuses") or []
        if not statuses or not statuses[0].get("containerID"):
            raise RuntimeError(f"pod {namespace}/{name} has no running container")
        container = str(statuses[0]["containerID"]).removeprefix("containerd://")
        runc_root = WORKDIR / "containerd" / "runc" / "k8s.io"
        state = subprocess.run(
            ["runc", "--root", str(runc_root), "state", container],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return int(json.loads(state.stdout)["pid"])

    def logs(self) -> Iterator[tuple[str, str]]:
        """The suite's pods' container logs, as the kubelet wrote them."""
        root = Path(self.env.get("LOGS", str(WORKDIR / "log"))) / "pods"
        for namespace in (topo.APP_NS, topo.INFRA_NS):
            for path in sorted(root.glob(f"{namespace}_*/*/*.log")):
                yield str(path.relative_to(root)), path.read_text(errors="replace")[-2000:]

    def close(self) -> None:
        self._http.close()


def _connects(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=2):
        return True
    return False


def _iptables(netns: str, *args: str) -> None:
    subprocess.run(
        ["nsenter", f"--net={netns}", "--", "iptables", *args],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
