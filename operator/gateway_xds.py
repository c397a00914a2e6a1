"""The operator's side of xDS: the ADS server it runs, and what each Gateway's Envoy is
told at start (bootstrap, arguments, readiness).

One small class over :class:`infergate.gateway.xds.AdsServer` so the reconcile loop
speaks in Gateway keys and "programmed or not", and the server's API is used in one place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from infergate.gateway.types import Key, Snapshot, node_id
from infergate.operator import constants as c
from infergate.operator.gateway_objects import ProxyConfig
from infergate.operator.settings import GatewaySettings

log = logging.getLogger("infergate.operator.gateway")

READY_PORT = 19001
"""Each Gateway Envoy's readiness listener (kubelet probes it on the pod IP)."""
READY_PATH = "/ready"
_T = "type.googleapis.com/envoy."
_HCM = _T + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_HEALTH_CHECK = _T + "extensions.filters.http.health_check.v3.HealthCheck"
_ROUTER = _T + "extensions.filters.http.router.v3.Router"


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


def proxy_config_factory(settings: GatewaySettings, port: int) -> Callable[[Key], ProxyConfig]:
    """Per Gateway, its Envoy's bootstrap and arguments (from the xDS side's builders):
    it dials ``settings.xds_address`` on ``port`` (the xDS server's, once listening)."""
    from infergate.gateway.bootstrap import (
        GatewayProxy,
        build_gateway_bootstrap,
        gateway_proxy_args,
    )

    def proxy_config(key: Key) -> ProxyConfig:
        proxy = GatewayProxy(node_id=node_id(*key), xds_host=settings.xds_address, xds_port=port)
        bootstrap = with_ready_listener(build_gateway_bootstrap(proxy), READY_PORT)
        args = gateway_proxy_args(f"{c.ENVOY_CONFIG_DIR}/{c.ENVOY_CONFIG_KEY}")
        return ProxyConfig(
            bootstrap=bootstrap,
            args=tuple(_without_config_path(args)),
            ready_port=READY_PORT,
            ready_path=READY_PATH,
        )

    return proxy_config


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


def with_ready_listener(bootstrap: dict[str, Any], port: int) -> dict[str, Any]:
    """``bootstrap`` plus a static listener answering ``GET /ready``: 200 once Envoy is
    initialised (it opens listeners only after its first config from the operator) and
    not failing health checks, else no answer or 503. Envoy's own /ready is on the admin
    interface, which stays on loopback (it can stop the proxy); the kubelet probes the
    pod IP."""
    listener = {
        "name": "infergate_ready",
        "address": {"socket_address": {"address": "0.0.0.0", "port_value": port}},
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": _HCM,
                            "stat_prefix": "infergate_ready",
                            "route_config": {"name": "infergate_ready", "virtual_hosts": []},
                            "http_filters": [
                                {
                                    "name": "envoy.filters.http.health_check",
                                    "typed_config": {
                                        "@type": _HEALTH_CHECK,
                                        "pass_through_mode": False,
                                        "headers": [
                                            {
                                                "name": ":path",
                                                "string_match": {"exact": READY_PATH},
                                            }
                                        ],
                                    },
                                },
                                {
                                    "name": "envoy.filters.http.router",
                                    "typed_config": {"@type": _ROUTER},
                                },
                            ],
                        },
                    }
                ]
            }
        ],
    }
    out = dict(bootstrap)
    static = dict(out.get("static_resources") or {})
    static["listeners"] = [*(static.get("listeners") or []), listener]
    out["static_resources"] = static
    return out


def translate_options(bundle_version: str | None) -> Any:
    """The translator's options: its defaults (TLS to EPPs, as the operator's EPPs serve
    it), and the installed Gateway API bundle version so GatewayClasses can say
    SupportedVersion."""
    from infergate.gateway.options import TranslateOptions

    return TranslateOptions(gateway_api_bundle_version=bundle_version)
