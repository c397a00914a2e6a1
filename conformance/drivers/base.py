"""The driver interface the conformance tests are written against.

A driver answers what GIE's suite gets from a cluster: the API server (``kube``), where
a Gateway answers (:meth:`Driver.gateway_address`, GIE's ``GetGatewayEndpoint``), and how
to send an HTTP request there (:meth:`Driver.send`). Everything else a test does goes
through the API server, as GIE's tests do: applying HTTPRoutes, reading statuses, making
an Endpoint Picker's Service select nothing. Tests never know which driver runs them; a
driver that cannot do something (stop a single model server behind the API's back) lacks
the capability and the test says so.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import httpx

from conformance import topology as topo
from conformance.kube import KubeApi, api_client_for

#: Single model-server pods can be stopped and started behind the API server's back.
STOP_PODS = "stop-pods"
#: The endpointslice controller fills a Service's EndpointSlices with its pods' addresses
#: (a real network: not the control-plane driver's loopback pod IPs, which the API refuses).
ENDPOINT_SLICES = "endpoint-slices"


@dataclass(frozen=True)
class Pod:
    """A model-server pod: its name, IP and the ports its containers declare."""

    name: str
    ip: str
    ports: tuple[int, ...]

    def endpoint(self, port: int | None = None) -> str:
        return f"{self.ip}:{port or self.ports[0]}"


@dataclass(frozen=True)
class Request:
    """One request as GIE's ``gwhttp.Request`` describes it."""

    path: str
    host: str = ""
    method: str = "GET"
    body: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Reply:
    """One response through a Gateway; the echo body says who served it."""

    status: int
    headers: Mapping[str, str]
    body: bytes
    echo: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, status: int, headers: Mapping[str, str], body: bytes) -> Reply:
        echo: dict[str, Any] = {}
        if "json" in headers.get("content-type", ""):
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and "pod" in parsed:
                echo = parsed
        return cls(status, {k.lower(): v for k, v in headers.items()}, body, echo)

    @property
    def pod(self) -> str | None:
        return self.echo.get("pod")

    @property
    def served(self) -> str | None:
        """``podIP:httpPort`` of the echo server that answered."""
        if not self.echo:
            return None
        return f"{self.echo.get('podIP')}:{self.echo.get('httpPort')}"

    def __repr__(self) -> str:
        return (
            f"Reply({self.status}, pod={self.pod}, served={self.served}, "
            f"proto={self.echo.get('proto')}, body={self.body[:160]!r})"
        )


class Driver(ABC):
    """Where the suite runs: ``controlplane`` (the real API server on loopback, processes
    for pods) or ``cluster`` (the cluster in $KUBECONFIG, e.g. kind)."""

    name: str
    capabilities: frozenset[str] = frozenset()
    #: Seconds a status or routing change may take to converge.
    settle_timeout: float = 90.0

    @property
    @abstractmethod
    def kube(self) -> KubeApi:
        """REST client for the API server (the base objects applied)."""

    @abstractmethod
    def gateway_address(self, gateway: str, namespace: str) -> str:
        """``host:port`` a client dials for the Gateway's first listener, from the
        address in its status (GIE: ``GetGatewayEndpoint``)."""

    @abstractmethod
    def send(self, address: str, request: Request) -> Reply:
        """One HTTP/1.1 request to ``address`` (a :meth:`gateway_address`)."""

    def pod_stopped(self, pod: Pod) -> AbstractContextManager[None]:
        """Within the block the pod's model server does not answer (needs STOP_PODS)."""
        raise NotImplementedError(f"the {self.name} driver cannot stop single pods")

    def logs(self) -> Iterator[tuple[str, str]]:
        """(name, tail) of the driver's own processes, for failing tests' reports."""
        return iter(())

    @abstractmethod
    def close(self) -> None:
        """Stop whatever the driver started."""


def connect(kubeconfig: str | None, gateway_class: str) -> tuple[KubeApi, httpx.Client]:
    """The API and HTTP clients of a driver whose cluster is already running (``cluster``,
    ``node``), with the suite's base objects applied for ``gateway_class``. The
    ``controlplane`` driver starts its own API server and applies its objects later."""
    kube = KubeApi(api_client_for(kubeconfig))
    print(f"[conformance] applying {topo.BASE_MANIFEST.name} (GatewayClass {gateway_class})")
    kube.apply_all(topo.base_objects(gateway_class))
    return kube, httpx.Client(timeout=30.0)
