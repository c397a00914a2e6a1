"""The bootstrap and command line of a Gateway's Envoy: everything else comes over ADS.

The bootstrap only says who the proxy is (node id = the Gateway's, shared by every
replica), where the operator's ADS server is, and the process-wide limits. Listeners,
routes, clusters and endpoints all arrive from :class:`infergate.gateway.xds.AdsServer`,
so a Gateway or HTTPRoute change never restarts a pod.

Choices and why:

* ``initial_fetch_timeout: 0s`` for CDS and LDS: an Envoy that cannot reach the operator
  stays not-ready (admin ``/ready`` answers 503) instead of going live with no config
  after 15 s and answering 404 to everything behind a Service that believes it ready.
* The xDS cluster: HTTP/2 with keepalive pings (a half-dead connection to an operator
  that moved is noticed in seconds, not at the kernel's TCP timeout), STRICT_DNS for a
  Service name, STATIC for an IP; reconnect backoff from 0.25 s up to 5 s, so a restarted
  operator is back in control within seconds. While disconnected Envoy keeps serving
  its last config.
* Drain (:func:`gateway_proxy_args`): a listener that an update modifies or removes is
  drained, not closed: ``--drain-strategy immediate`` tells every connection of the old
  listener at once to finish (HTTP/1.1 ``Connection: close`` after the response in
  flight, HTTP/2 GOAWAY), so new requests reach the new listener quickly, while
  ``--drain-time-s`` is how long streams already in flight may run before Envoy closes
  what is left: long enough for a streamed generation. Route and cluster updates drain
  nothing: a request in flight keeps the route and upstream connection it started on.
* Node metadata ``infergate.io/bind-address: $(POD_IP)`` goes on the command line
  (``--config-yaml`` merges into the bootstrap), not into the bootstrap file, because the
  file is one ConfigMap for every replica and Kubernetes expands ``$(VAR)`` only in a
  container's command and args. Why the server wants it: :mod:`infergate.gateway.xds`.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infergate.envoy.bootstrap import ENVOY_MAX_HEAP_BYTES, overload_manager
from infergate.gateway.static import runtime_layer
from infergate.gateway.xds import BIND_ADDRESS_KEY

XDS_CLUSTER = "infergate_xds"
ADMIN_CLUSTER = "infergate_admin"
NODE_CLUSTER = "infergate-gateway"
POD_IP_ARG = "$(POD_IP)"
"""Kubernetes expands it in args from the container's ``POD_IP`` env var (:data:`POD_IP_ENV`)."""
POD_IP_ENV = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
"""The container env entry (downward API) that :data:`POD_IP_ARG` needs."""
DRAIN_TIME_S = 600
"""How long streams on a modified or removed listener may run: a long generation."""

_T = "type.googleapis.com/envoy."
_HTTP_OPTIONS = _T + "extensions.upstreams.http.v3.HttpProtocolOptions"
_HCM = _T + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = _T + "extensions.filters.http.router.v3.Router"


@dataclass(frozen=True)
class GatewayProxy:
    """One Gateway's proxy, as its bootstrap needs it.

    ``admin_socket`` (a path) replaces the TCP admin port when set: nothing else in the
    pod can then reach the admin API. ``admin_port=None`` and no socket: no admin."""

    node_id: str
    xds_host: str
    xds_port: int
    node_cluster: str = NODE_CLUSTER
    admin_address: str = "127.0.0.1"
    admin_port: int | None = 19000
    admin_socket: str | None = None
    xds_connect_timeout_s: float = 2.0
    keepalive_interval_s: float = 15.0
    keepalive_timeout_s: float = 5.0
    reconnect_base_s: float = 0.25
    reconnect_max_s: float = 5.0
    max_downstream_connections: int = 50_000
    max_heap_bytes: int = ENVOY_MAX_HEAP_BYTES
    """The overload manager's heap bound (``infergate.envoy.bootstrap.overload_manager``)."""
    ready_port: int | None = None
    """A listener that answers ``GET /ready`` from the admin API, for the kubelet's
    readiness probe (the admin API itself stays on loopback or a socket)."""
    ready_address: str = "0.0.0.0"

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ValueError("node_id must not be empty")
        if self.ready_port is not None and _admin(self) is None:
            raise ValueError("ready_port needs the admin API (admin_port or admin_socket)")
        for name in ("xds_port", "admin_port", "ready_port"):
            port = getattr(self, name)
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"{name} out of range: {port}")
        if not 0 < self.reconnect_base_s <= self.reconnect_max_s:
            raise ValueError("need 0 < reconnect_base_s <= reconnect_max_s")


def build_gateway_bootstrap(proxy: GatewayProxy) -> dict[str, Any]:
    """Envoy's v3 bootstrap (as dicts) for a Gateway proxy fed by the ADS server."""
    ads = {"ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": "0s"}
    bootstrap: dict[str, Any] = {
        "node": {"id": proxy.node_id, "cluster": proxy.node_cluster},
        "dynamic_resources": {
            "ads_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "set_node_on_first_message_only": True,
                "grpc_services": [
                    {
                        "envoy_grpc": {
                            "cluster_name": XDS_CLUSTER,
                            "retry_policy": {
                                "retry_back_off": {
                                    "base_interval": _duration(proxy.reconnect_base_s),
                                    "max_interval": _duration(proxy.reconnect_max_s),
                                }
                            },
                        }
                    }
                ],
            },
            "cds_config": ads,
            "lds_config": dict(ads),
        },
        "static_resources": {"clusters": [_xds_cluster(proxy)]},
        # The same heap bound and connection cap as the standalone Envoy's.
        "overload_manager": overload_manager(
            proxy.max_heap_bytes, proxy.max_downstream_connections
        ),
        # The translator's regexes may exceed Envoy's default RE2 program-size limit (100),
        # which would reject a whole route table; it bounds them itself (static.py).
        "layered_runtime": runtime_layer(),
    }
    admin = _admin(proxy)
    if admin is not None:
        bootstrap["admin"] = admin
    if proxy.ready_port is not None:
        assert admin is not None  # checked in GatewayProxy
        static = bootstrap["static_resources"]
        static["clusters"].append(_admin_cluster(admin["address"]))
        static["listeners"] = [_ready_listener(proxy.ready_address, proxy.ready_port)]
    return bootstrap


def render_gateway_bootstrap(proxy: GatewayProxy) -> str:
    """The bootstrap as JSON text (for a ``bootstrap.json`` file or ConfigMap key).

    JSON, not YAML: Envoy reads YAML 1.1, where a bare ``n``, ``y`` or ``off`` is a
    boolean, so a node id or a name that happens to spell one would not survive a YAML
    dump that only quotes what PyYAML's own resolver considers special."""
    return json.dumps(build_gateway_bootstrap(proxy), indent=2, sort_keys=True)


def gateway_proxy_args(
    bootstrap_path: str | Path,
    *,
    bind_address: str | None = POD_IP_ARG,
    drain_time_s: int = DRAIN_TIME_S,
    concurrency: int | None = None,
    log_level: str = "info",
    extra_metadata: Mapping[str, str] | None = None,
) -> list[str]:
    """Envoy's arguments (after the binary) for a Gateway proxy.

    ``bind_address`` is an IP or ``$(POD_IP)`` for Kubernetes to expand; None leaves
    the listeners on the translator's addresses. ``concurrency`` None: Envoy's default
    (one worker per CPU it may use)."""
    args = ["-c", str(bootstrap_path), "--log-level", log_level]
    metadata = dict(extra_metadata or {})
    if bind_address is not None:
        metadata[BIND_ADDRESS_KEY] = bind_address
    if metadata:
        args += ["--config-yaml", json.dumps({"node": {"metadata": metadata}})]
    args += ["--drain-time-s", str(drain_time_s), "--drain-strategy", "immediate"]
    # One Envoy per pod: hot restart (shared memory between generations) buys nothing
    # and would make two proxies on one host collide on the default base id.
    args.append("--disable-hot-restart")
    if concurrency is not None:
        args += ["--concurrency", str(concurrency)]
    return args


def _xds_cluster(proxy: GatewayProxy) -> dict[str, Any]:
    keepalive = {
        "interval": _duration(proxy.keepalive_interval_s),
        "timeout": _duration(proxy.keepalive_timeout_s),
    }
    return {
        "name": XDS_CLUSTER,
        "type": "STATIC" if _is_ip(proxy.xds_host) else "STRICT_DNS",
        "connect_timeout": _duration(proxy.xds_connect_timeout_s),
        "load_assignment": {
            "cluster_name": XDS_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": _socket(proxy.xds_host, proxy.xds_port)}}
                    ]
                }
            ],
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _HTTP_OPTIONS,
                "explicit_http_config": {
                    "http2_protocol_options": {"connection_keepalive": keepalive}
                },
            }
        },
        # The kernel notices a peer that vanished (no RST) too, even between pings.
        "upstream_connection_options": {
            "tcp_keepalive": {"keepalive_time": 30, "keepalive_interval": 5, "keepalive_probes": 3}
        },
    }


def _ready_listener(address: str, port: int) -> dict[str, Any]:
    """``/ready`` proxied to the admin API, 404 for anything else.

    Envoy opens listeners only once initialized, i.e. once CDS and LDS answered: until
    then the probe's connection is refused; afterwards the admin's answer follows
    Envoy's state (503 while it drains for shutdown, after ``POST /healthcheck/fail``).

    ``enable_reuse_port: false``: two proxies sharing a network namespace by mistake
    fail to bind instead of answering each other's probes."""
    routes = [
        {"match": {"path": "/ready"}, "route": {"cluster": ADMIN_CLUSTER}},
        {"match": {"prefix": "/"}, "direct_response": {"status": 404}},
    ]
    hcm = {
        "@type": _HCM,
        "stat_prefix": "infergate_ready",
        "route_config": {"virtual_hosts": [{"name": "ready", "domains": ["*"], "routes": routes}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}],
    }
    return {
        "name": "infergate_ready",
        "address": _socket(address, port),
        "enable_reuse_port": False,
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }


def _admin_cluster(address: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": ADMIN_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": ADMIN_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
        },
    }


def _admin(proxy: GatewayProxy) -> dict[str, Any] | None:
    if proxy.admin_socket is not None:
        return {"address": {"pipe": {"path": proxy.admin_socket, "mode": 0o600}}}
    if proxy.admin_port is None:
        return None
    return {"address": _socket(proxy.admin_address, proxy.admin_port)}


def _socket(address: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": address, "port_value": port}}


def _duration(seconds: float) -> str:
    if seconds < 0:
        raise ValueError(f"durations must be >= 0, got {seconds}")
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
