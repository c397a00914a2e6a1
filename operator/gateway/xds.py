"""The operator's side of xDS: the ADS server it runs, and what each Gateway's Envoy is
told at start (bootstrap, arguments, readiness).

One small class over :class:`infergate.gateway.xds.AdsServer` so the reconcile loop
speaks in Gateway keys and "programmed or not", and the server's API is used in one place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from infergate.gateway.types import Key, Obj, Snapshot, node_id
from infergate.operator import constants as c
from infergate.operator.gateway.objects import ProxyConfig, listener_ports
from infergate.operator.settings import GatewaySettings, OperatorSettings

log = logging.getLogger("infergate.operator.gateway")

READY_PORT = 19001
"""Each Gateway Envoy's readiness listener (kubelet probes it on the pod IP)."""
READY_PATH = "/ready"
ADMIN_PORT = 19000
"""The admin API's port, on loopback (it can stop the proxy): ``/ready`` is proxied."""
DRAIN_PORT = 19002
"""The pod's shutdown manager (infergate.envoy.drain): Envoy's preStop hook calls it."""


class XdsPublisher:
    """The ADS server, as the reconcile loop uses it."""

    def __init__(self, settings: GatewaySettings) -> None:
        from infergate.gateway.xds import AdsServer

        self.settings = settings
        self.server = AdsServer()
        self.port = 0
        self._published: set[str] = set()

    async def start(self) -> int:
        """Listen; a port already taken is fatal (two operators would split the Envoys)."""
        address = f"{self.settings.xds_listen_address}:{self.settings.xds_port}"
        try:
            self.port = await self.server.start(address)
        except RuntimeError as error:
            raise RuntimeError(f"cannot listen on {address}: {error}") from error
        if not self.port:
            raise RuntimeError(f"cannot listen on {address}")
        return self.port

    async def stop(self) -> None:
        await self.server.stop()

    def on_ack(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when any proxy's state changes (connect, ACK, NACK): the
        Gateways' Programmed conditions follow."""
        self.server.add_listener(lambda _node, _status: callback())

    def acked(self, node: str) -> bool:
        """Every connected replica of ``node`` serves its current snapshot completely."""
        return bool(self.server.status(node).applied)

    def publish_all(self, snapshots: Mapping[Key, Snapshot]) -> list[str]:
        """Make ``snapshots`` the whole published state; returns the node ids whose config
        changed. A Gateway no longer served is forgotten (its proxies, if any are left,
        keep their last config until garbage collection removes them)."""
        changed = []
        wanted = {node_id(*key): snapshot for key, snapshot in snapshots.items()}
        for node, snapshot in sorted(wanted.items()):
            before = self.server.snapshot(node)
            if self.server.set_snapshot(node, snapshot) and not _same(before, snapshot):
                changed.append(node)
        for node in sorted(self._published - set(wanted)):
            self.server.remove_snapshot(node)
            changed.append(node)
        self._published = set(wanted)
        return changed


def _same(before: Snapshot | None, after: Snapshot) -> bool:
    if before is None:
        return False
    return all(before.version(t) == after.version(t) for t in after.resources)


def proxy_config_factory(settings: GatewaySettings, port: int) -> Callable[[Obj], ProxyConfig]:
    """Per Gateway, its Envoy's bootstrap and arguments (from the xDS side's builders):
    it dials ``settings.xds_address`` on ``port`` (the xDS server's, once listening) and
    answers the kubelet's readiness probe on a port none of its listeners uses."""
    from infergate.gateway.bootstrap import (
        GatewayProxy,
        build_gateway_bootstrap,
        gateway_proxy_args,
    )

    def proxy_config(gateway: Obj) -> ProxyConfig:
        meta = gateway.get("metadata") or {}
        listeners = {p.port for p in listener_ports(gateway)}
        ready = ready_port(listeners)
        drain = free_port(DRAIN_PORT, listeners | {ready})
        proxy = GatewayProxy(
            node_id=node_id(str(meta.get("namespace") or ""), str(meta.get("name") or "")),
            xds_host=settings.xds_address,
            xds_port=port,
            admin_port=ADMIN_PORT,
            ready_port=ready,
            # Below the Envoy container's memory limit (gateway_objects), as the sidecar's.
            max_heap_bytes=OperatorSettings.from_env().envoy_max_heap_bytes,
        )
        args = gateway_proxy_args(f"{c.ENVOY_CONFIG_DIR}/{c.ENVOY_CONFIG_KEY}")
        return ProxyConfig(
            bootstrap=build_gateway_bootstrap(proxy),
            args=tuple(_without_config_path(args)),
            ready_port=ready,
            ready_path=READY_PATH,
            admin_port=ADMIN_PORT,
            drain_port=drain,
        )

    return proxy_config


def ready_port(taken: set[int]) -> int:
    """READY_PORT, or the next port that neither a listener of the Gateway nor the admin
    API uses (the proxy would fail to bind it)."""
    return free_port(READY_PORT, taken)


def free_port(start: int, taken: set[int]) -> int:
    """``start``, or the next port that is neither in ``taken`` nor the admin API's: the
    pod's containers share one network namespace."""
    port = start
    while port in taken or port == ADMIN_PORT:
        port += 1
    return port


def _without_config_path(args: list[str]) -> list[str]:
    """The builders pass the bootstrap path themselves (``--config-path``)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in ("-c", "--config-path"):
            skip = True
            continue
        out.append(arg)
    return out


def translate_options(bundle_version: str | None) -> Any:
    """The translator's options: its defaults (TLS to EPPs, as the operator's EPPs serve
    it), and the installed Gateway API bundle version so GatewayClasses can say
    SupportedVersion."""
    from infergate.gateway.options import TranslateOptions

    return TranslateOptions(gateway_api_bundle_version=bundle_version)
