"""The driver interface the conformance tests are written against.

A driver answers three questions for a test: where are the objects (``kube``, a REST
client for an API server the infergate operator watches), where do requests go
(``send`` to a named route of :mod:`conformance.topology`) and how to break things on
purpose (make a pool's EPP unavailable). Tests never know which driver runs them; what
a driver cannot do is a missing capability, and the test skips saying so.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from conformance.kube import KubeApi

#: A Gateway API implementation runs: HTTPRoute status and per-Gateway pool parents exist.
GATEWAY_API = "gateway-api"
#: Single backend pods can be stopped and started (local processes).
STOP_PODS = "stop-pods"


@dataclass(frozen=True)
class Pod:
    """A model-server pod of a pool: the echo server behind one IP, one port per rank."""

    name: str
    ip: str
    ports: tuple[int, ...]

    def endpoint(self, port: int | None = None) -> str:
        return f"{self.ip}:{port or self.ports[0]}"


@dataclass
class Reply:
    """One response through the gateway; the echo body says who served it."""

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
            f"Reply({self.status}, pod={self.pod}, served={self.served}, body={self.body[:160]!r})"
        )


class Driver(ABC):
    """Where the suite runs: ``local`` (processes on loopback) or ``cluster`` (kind)."""

    name: str
    capabilities: frozenset[str] = frozenset()
    #: Seconds a status or routing change may take to converge.
    settle_timeout: float = 60.0

    @property
    @abstractmethod
    def kube(self) -> KubeApi:
        """REST client for the API server the operator watches (base objects applied)."""

    @abstractmethod
    def pods(self, pool: str) -> list[Pod]:
        """The ready pods a pool's selector matches, in a stable order."""

    @abstractmethod
    def send(
        self,
        route: str,
        *,
        headers: Mapping[str, str] | None = None,
        body: Any = None,
        method: str = "POST",
    ) -> Reply:
        """One request to a route of :data:`conformance.topology.ROUTES`."""

    @abstractmethod
    def epp_unavailable(self, pool: str) -> AbstractContextManager[None]:
        """Within the block the pool's Endpoint Picker cannot be reached."""

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
        """One request to a Gateway by hostname and path (needs GATEWAY_API)."""
        raise NotImplementedError(f"the {self.name} driver runs no Gateway API implementation")

    @abstractmethod
    def picker_available(self, pool: str) -> None:
        """Return once the operator's EPP Deployment for ``pool`` is available."""

    def pod_stopped(self, pod: Pod) -> AbstractContextManager[None]:
        """Within the block the pod's echo server does not answer (needs STOP_PODS)."""
        raise NotImplementedError(f"the {self.name} driver cannot stop single pods")

    def logs(self) -> Iterator[tuple[str, str]]:
        """(name, tail) of the driver's own processes, for failing tests' reports."""
        return iter(())

    @abstractmethod
    def close(self) -> None:
        """Stop whatever the driver started."""
