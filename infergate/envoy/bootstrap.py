"""Envoy v3 bootstrap for an InferencePool: ext_proc to the Endpoint Picker, EDS upstream.

One pure function builds the whole bootstrap as plain dicts, so ``infergate up``, the
operator's standalone Envoy sidecar and the conformance helpers all run the same config.
Envoy 1.40 validates it (``envoy --mode validate``; see tests/stack).

Why each piece is there:

* ``ext_proc`` streams request and response bodies FULL_DUPLEX_STREAMED: the EPP must see
  the whole OpenAI body before it can pick, and must pass SSE chunks straight back without
  buffering. That body mode requires the matching trailer mode to be SEND. Because the
  EPP answers the request-headers message only after the last body chunk, the per-message
  timeout must cover the client's upload, hence seconds, not Envoy's 200 ms default.
* The EPP's pick arrives in GIE's two carriers, each in a form its readers parse: the
  ``x-gateway-destination-endpoint`` header names the primary pick alone (one
  ``ip:port``), and dynamic metadata ``envoy.lb`` / ``x-gateway-destination-endpoint``
  holds the ordered list (``ip:port,ip:port,…``, primary first). The pool cluster uses
  Envoy's ``override_host`` policy reading that metadata: it dials the first endpoint of
  the list and, on a retry (connect failure, refused stream, reset before the request
  went out), the next one — GIE's fallback list. ``override_host`` only dials hosts its
  cluster has, so the cluster learns the pool's endpoints from the EPP itself over EDS
  (the EPP serves it on the ext-proc port), and keeps the last set if the EPP dies. The
  header is stripped from client requests first, so a client can never choose an
  upstream itself.
* ``upstream="original_dst"`` swaps that pool cluster for the one GIE's and llm-d-router's
  reference configs use: an ``ORIGINAL_DST`` cluster that dials whatever address the
  ``x-gateway-destination-endpoint`` header names (one address, which is why the EPP
  puts only its primary there: Envoy 1.40 fails a list in that header with 503 UH; no
  EDS, no fallback, no fail-open). It exists so an external EPP that does not serve EDS
  (the routing lab's ``external-epp`` peer) runs behind this same listener and filter
  chain, and to prove the EPP serves behind GIE's reference configuration.
* Only requests that carry a pick in the ``envoy.lb`` metadata (which, unlike a header,
  only the EPP can set) take the retrying route. The rest (the EPP was unreachable and
  ``failure_mode_allow`` let the request through) are balanced least-request over a static
  fallback cluster when one is given, else over the endpoints the EPP last announced.
* The EPP cluster speaks TLS when the EPP does (``epp_tls``, GIE's ``--secure-serving``;
  like GIE's gateways it does not verify the EPP's certificate, which is self-signed by
  default; with ``epp_mtls`` it verifies it against a CA and presents a client
  certificate, for an EPP run with ``--client-ca-file``), and is health-checked with gRPC health (service ``liveness``) on the ext-proc
  port itself, over the same transport: a TLS mismatch, or a port that accepts TCP but
  does not speak gRPC, shows as unhealthy instead of failing every request. Panic routing
  is off: with FULL_DUPLEX_STREAMED
  bodies Envoy can fail open only before the first body chunk went out, so a dead EPP
  must be known before the request starts, not discovered at connect time.
* The overload manager bounds Envoy's heap (:func:`overload_manager`): free heap is
  returned near the bound and new requests are refused at it.
* On the way back the upstream really used is copied into ``envoy.lb`` as
  ``x-gateway-destination-endpoint-served`` and forwarded to the EPP with the response
  headers, as GIE's protocol asks.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from infergate.options import option
from infergate.wire.names import (
    DESTINATION_HEADER,
    LB_METADATA_NAMESPACE,
    MAX_REQUEST_BODY_BYTES,
    ORDER_DELAY_HEADER,
    PREFIX_HEADER,
    REQUEST_ID_HEADER,
    SERVED_HEADER,
)

__all__ = [
    "DESTINATION_HEADER",
    "ENVOY_MAX_HEAP_BYTES",
    "EPP_CLUSTER",
    "EPP_HEALTH_SERVICE",
    "EPP_STREAM_RETRY",
    "FALLBACK_CLUSTER",
    "LB_METADATA_NAMESPACE",
    "PICKED_HEADER",
    "POOL_CLUSTER",
    "REQUEST_ID_HEADER",
    "RESPONSE_ACCOUNTING",
    "SERVED_HEADER",
    "UPSTREAMS",
    "UPSTREAM_HOST_HEADER",
    "EnvoyConfig",
    "EppMutualTls",
    "build_envoy_config",
    "circuit_breakers",
    "duration",
    "engine_protocol_options",
    "epp_health_checks",
    "epp_tls_transport_socket",
    "ext_proc_filter",
    "fallback_retry_policy",
    "grpc_protocol_options",
    "header_value_option",
    "is_ip",
    "overload_manager",
    "override_host_policy",
    "render_envoy_yaml",
    "served_to_metadata_filter",
    "socket_address",
    "strip_client_headers_filter",
]

RESPONSE_ACCOUNTING = ("engine", "observer", "body", "none")
"""How the EPP learns a response's end and usage (see :func:`build_envoy_config`)."""
UPSTREAMS = ("eds", "original_dst")
"""How Envoy finds the picked endpoint (see :func:`build_envoy_config`)."""
REQUEST_BODY_MODES = {"streamed": "FULL_DUPLEX_STREAMED", "buffered": "BUFFERED"}
""":attr:`EnvoyConfig.request_body_mode` -> ext_proc's ``request_body_mode``."""
UPSTREAM_HOST_HEADER = "x-infergate-upstream-host"
"""Debug response header: the upstream Envoy really dialled (``%UPSTREAM_HOST%``)."""
PICKED_HEADER = "x-infergate-picked-endpoint"
"""Debug response header: the EPP's ordered pick list, as it set it in ``envoy.lb``
metadata ``x-gateway-destination-endpoint`` (the header of that name holds the first)."""
EPP_CLUSTER = "infergate_epp"
ENVOY_MAX_HEAP_BYTES = 1 << 30
"""Envoy's heap bound (the overload manager's ``fixed_heap``): 1 GiB, the operator's
default memory limit for its Envoy containers."""
SHRINK_HEAP_AT = 0.95
"""Fraction of the heap bound at which Envoy returns free heap to the kernel."""
STOP_REQUESTS_AT = 0.98
"""Fraction of the heap bound at which Envoy answers new requests 503."""
EPP_HEALTH_SERVICE = "liveness"
"""gRPC health service the EPP reports SERVING while it runs, on its ext-proc port too."""
POOL_CLUSTER = "infergate_pool"
FALLBACK_CLUSTER = "infergate_pool_fallback"

_T = "type.googleapis.com/envoy."
_HCM = _T + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_PROC = _T + "extensions.filters.http.ext_proc.v3.ExternalProcessor"
_UPSTREAM_TLS = _T + "extensions.transport_sockets.tls.v3.UpstreamTlsContext"
_FIXED_HEAP = "envoy.resource_monitors.fixed_heap"
_HEADER_MUTATION = _T + "extensions.filters.http.header_mutation.v3.HeaderMutation"
_ROUTER = _T + "extensions.filters.http.router.v3.Router"
_HEADER_TO_METADATA = _T + "extensions.filters.http.header_to_metadata.v3.Config"
_OVERRIDE_HOST = _T + "extensions.load_balancing_policies.override_host.v3.OverrideHost"
_PREVIOUS_HOSTS = _T + "extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
_LEAST_REQUEST = _T + "extensions.load_balancing_policies.least_request.v3.LeastRequest"

_HTTP_OPTIONS = _T + "extensions.upstreams.http.v3.HttpProtocolOptions"
_STDOUT_LOG = _T + "extensions.access_loggers.stream.v3.StdoutAccessLog"

_ACCESS_LOG_FORMAT = (
    '[%START_TIME%] "%REQ(:METHOD)% %REQ(:PATH)%" %RESPONSE_CODE% %RESPONSE_FLAGS% '
    "picked=%REQ(X-GATEWAY-DESTINATION-ENDPOINT)% upstream=%UPSTREAM_HOST% "
    "duration_ms=%DURATION% upstream_ms=%RESPONSE_DURATION%\n"
)


def duration(seconds: float) -> str:
    """Envoy's JSON duration: a decimal number of seconds with an ``s`` suffix."""
    if seconds < 0:
        raise ValueError(f"durations must be >= 0, got {seconds}")
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


def socket_address(address: str, port: int) -> dict[str, Any]:
    if not 0 < port < 65536:
        raise ValueError(f"port out of range: {port}")
    return {"socket_address": {"address": address, "port_value": port}}


def is_ip(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


def circuit_breakers(max_requests: int) -> dict[str, Any]:
    # Envoy's defaults (1024 each) would throttle long streaming generations well below
    # what an inference pool can hold in flight. Retries too: Envoy allows 3 at once per
    # cluster by default, and when an engine dies every request picked to it retries at
    # the same moment; past 3 they failed with 503 (``UO``) instead of taking the
    # fallback (issue 45). A retry is a request that failed, so it is bounded alike.
    return {
        "thresholds": [
            {
                "max_connections": max_requests,
                "max_pending_requests": max_requests,
                "max_requests": max_requests,
                "max_retries": max_requests,
            }
        ]
    }


def _static_cluster(
    name: str,
    endpoints: Sequence[tuple[str, int]],
    *,
    connect_timeout_s: float,
    max_requests: int,
    protocol_options: dict[str, Any],
) -> dict[str, Any]:
    """A cluster of fixed endpoints, speaking as ``protocol_options`` say
    (:func:`grpc_protocol_options` toward an EPP, :func:`engine_protocol_options` toward
    engines)."""
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if all(is_ip(host) for host, _ in endpoints) else "STRICT_DNS",
        "connect_timeout": duration(connect_timeout_s),
        "lb_policy": "LEAST_REQUEST",
        "circuit_breakers": circuit_breakers(max_requests),
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": socket_address(host, port)}}
                        for host, port in endpoints
                    ]
                }
            ],
        },
    }
    if not is_ip(endpoints[0][0]):
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    cluster["typed_extension_protocol_options"] = protocol_options
    return cluster


def grpc_protocol_options(streams_per_connection: int = 100000) -> dict[str, Any]:
    """HTTP/2 toward an EPP: one gRPC stream per HTTP request, so allow plenty per
    connection, and keep idle connections alive.

    Envoy opens at most the smaller of ``streams_per_connection`` and the EPP's
    SETTINGS_MAX_CONCURRENT_STREAMS (``--max-streams`` + 1,000, below this default) on a
    connection, and resets the stream of each client that goes away. The EPP's HTTP/2
    server sizes its reset limits from that same concurrency (native/grpc_h2, ``Limits``),
    so a burst of client aborts never makes it close the connection under other streams.
    """
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _HTTP_OPTIONS,
            "explicit_http_config": {
                "http2_protocol_options": {
                    "max_concurrent_streams": streams_per_connection,
                    "connection_keepalive": {"interval": "30s", "timeout": "5s"},
                }
            },
        }
    }


#: With several replicas: an ext-proc stream whose connection fails (a replica just died,
#: not yet ejected) is opened again on another replica before any message went out.
EPP_STREAM_RETRY: dict[str, Any] = {
    "retry_on": "connect-failure,refused-stream,reset",
    "num_retries": 2,
    "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"},
    "retry_host_predicate": [
        {
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {
                "@type": _T + "extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
            },
        }
    ],
    "host_selection_retry_max_attempts": 3,
}


def _epp_replica_failover() -> dict[str, Any]:
    """Ext_proc cluster settings for several EPP replicas: a replica whose connection
    fails is ejected at its first local-origin failure (outlier detection), before the
    next health check, so the next request's stream opens on a live one."""
    return {
        "outlier_detection": {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,
            "enforcing_consecutive_local_origin_failure": 100,
            "consecutive_5xx": 1000,
            "enforcing_consecutive_5xx": 0,
            "consecutive_gateway_failure": 1000,
            "enforcing_consecutive_gateway_failure": 0,
            "enforcing_success_rate": 0,
            "interval": "1s",
            "base_ejection_time": "5s",
            "max_ejection_percent": 100,
        },
    }


def ext_proc_filter(
    *,
    failure_mode_allow: bool,
    message_timeout_s: float,
    grpc_authority: str,
    response_bodies: bool,
    cluster_name: str = EPP_CLUSTER,
    request_body_mode: str = "streamed",
) -> dict[str, Any]:
    """The routing filter; without ``response_bodies`` Envoy ends its stream after the
    response headers (the EPP learns the rest from the engine or the observer).
    ``request_body_mode`` is :attr:`EnvoyConfig.request_body_mode`."""
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _EXT_PROC,
            "grpc_service": {
                "envoy_grpc": {"cluster_name": cluster_name, "authority": grpc_authority},
            },
            "failure_mode_allow": failure_mode_allow,
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": REQUEST_BODY_MODES[request_body_mode],
                "response_body_mode": "FULL_DUPLEX_STREAMED" if response_bodies else "NONE",
                # FULL_DUPLEX_STREAMED requires the trailer modes to be SEND.
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SEND" if response_bodies else "SKIP",
            },
            # The EPP answers headers only after the full body: give uploads time.
            "message_timeout": duration(message_timeout_s),
            "max_message_timeout": duration(max(message_timeout_s, 300.0)),
            # Lets the EPP skip response-body streaming per request (e.g. non-streaming).
            "allow_mode_override": True,
            "metadata_options": {
                "receiving_namespaces": {"untyped": [LB_METADATA_NAMESPACE]},
                # The response-headers message then carries the served endpoint.
                "forwarding_namespaces": {"untyped": [LB_METADATA_NAMESPACE]},
            },
        },
    }


def _observer_filter(*, grpc_authority: str) -> dict[str, Any]:
    """A second ext_proc filter in observability mode: Envoy streams it the response
    headers and body without waiting for answers and ignores its failures, so what the EPP
    learns from responses (usage, cached tokens, completion) costs no round trip per chunk
    and the EPP dying cuts no response. The EPP ties it to its request by the
    ``x-infergate-request-id`` header it set when routing."""
    return {
        "name": "infergate.ext_proc.observer",
        "typed_config": {
            "@type": _EXT_PROC,
            "grpc_service": {
                "envoy_grpc": {"cluster_name": EPP_CLUSTER, "authority": grpc_authority},
            },
            "observability_mode": True,
            "failure_mode_allow": True,
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": "NONE",
                "response_body_mode": "STREAMED",
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SKIP",
            },
            # Envoy keeps the stream this long after the response so the last chunk arrives.
            "deferred_close_timeout": "5s",
        },
    }


def strip_client_headers_filter() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": _HEADER_MUTATION,
            "mutations": {
                "request_mutations": [
                    {"remove": name}
                    for name in (
                        DESTINATION_HEADER,
                        REQUEST_ID_HEADER,
                        PREFIX_HEADER,
                        ORDER_DELAY_HEADER,
                    )
                ]
            },
        },
    }


def header_value_option(key: str, value: str) -> dict[str, Any]:
    return {"header": {"key": key, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}


#: Envoy closes an idle engine connection after this, before the engine's own 5 s.
UPSTREAM_IDLE_S = 4.0


#: How Envoy redials the EPP's EDS stream (``EnvoyGrpc.retry_policy``, which xDS streams
#: honour): every 0.25-1 s. Envoy's own default backs off exponentially from 0.5 s to 30 s,
#: so an Envoy that came up before its EPP (a pod whose sidecar starts first, an EPP
#: rollout) learnt the pool 10-21 s after the EPP was ready, serving 503 "no healthy
#: upstream" meanwhile; with this, 0.5-1.0 s (Envoy started 18-31 s before its EPP; both
#: measured, docs/benchmarks/resilience.md). A redial is one TCP connect to the EPP's port: cheap,
#: even for many Envoys.
#: (``GrpcService.retry_policy`` is not this: it retries the stream's opening call.)
EDS_RECONNECT: dict[str, Any] = {
    "retry_back_off": {"base_interval": "0.25s", "max_interval": "1s"}
}


def _pool_cluster(
    *, connect_timeout_s: float, max_requests: int, initial_fetch_timeout_s: float
) -> dict[str, Any]:
    """The pool's engines, learnt from the EPP over EDS, picked by ``override_host``.

    ``override_host`` dials the EPP's pick (metadata ``envoy.lb`` /
    ``x-gateway-destination-endpoint``, ``ip:port[,ip:port…]``), moves down that list on
    each retry, and balances
    least-request over the known endpoints when a request carries no pick (fail open).
    """
    return {
        "name": POOL_CLUSTER,
        "type": "EDS",
        # Engines' servers (uvicorn, vLLM's too) close a keep-alive connection idle for
        # 5 s; a request Envoy writes on it as it closes fails with "connection
        # termination" (a 503, not retried: the request went out). Closing first avoids it.
        "typed_extension_protocol_options": engine_protocol_options(http2=False),
        "connect_timeout": duration(connect_timeout_s),
        "circuit_breakers": circuit_breakers(max_requests),
        "eds_cluster_config": {
            "eds_config": {
                "resource_api_version": "V3",
                # Past this Envoy serves without the pool (picks then fail over to
                # nothing) rather than holding its listener back; EDS keeps retrying.
                "initial_fetch_timeout": duration(initial_fetch_timeout_s),
                "api_config_source": {
                    "api_type": "GRPC",
                    "transport_api_version": "V3",
                    "grpc_services": [
                        {"envoy_grpc": {"cluster_name": EPP_CLUSTER, "retry_policy": EDS_RECONNECT}}
                    ],
                    "set_node_on_first_message_only": True,
                },
            }
        },
        "load_balancing_policy": override_host_policy(),
    }


def engine_protocol_options(*, http2: bool) -> dict[str, Any]:
    """Upstream HTTP options toward engines: HTTP/1.1, or h2c when ``http2`` (GIE's
    ``appProtocol: kubernetes.io/h2c``), closing idle connections before the engine does."""
    protocol: dict[str, Any] = (
        {"http2_protocol_options": {"max_concurrent_streams": 100000}}
        if http2
        else {"http_protocol_options": {}}
    )
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _HTTP_OPTIONS,
            "common_http_protocol_options": {"idle_timeout": duration(UPSTREAM_IDLE_S)},
            "explicit_http_config": protocol,
        }
    }


def override_host_policy() -> dict[str, Any]:
    """The pool cluster's load balancing: dial the EPP's pick and walk its fallback list
    on retries; without a pick, least-request over the pool.

    The list is read from dynamic metadata ``envoy.lb`` / ``x-gateway-destination-endpoint``
    (``ip:port[,ip:port…]``, primary first), where the EPP puts it; the header of the same
    name holds only the primary, for data planes that dial one address."""
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        "@type": _OVERRIDE_HOST,
                        # The EPP's ordered list, from the envoy.lb metadata only the EPP
                        # can set (the header carries just the primary pick; Envoy joins
                        # every source given, so the header is not listed too).
                        "override_host_sources": [
                            {
                                "metadata": {
                                    "key": LB_METADATA_NAMESPACE,
                                    "path": [{"key": DESTINATION_HEADER}],
                                }
                            }
                        ],
                        "fallback_policy": {
                            "policies": [
                                {
                                    "typed_extension_config": {
                                        "name": "envoy.load_balancing_policies.least_request",
                                        "typed_config": {"@type": _LEAST_REQUEST},
                                    }
                                }
                            ]
                        },
                    },
                }
            }
        ]
    }


def _original_dst_cluster(*, connect_timeout_s: float, max_requests: int) -> dict[str, Any]:
    """GIE's reference pool cluster: dial the address in ``x-gateway-destination-endpoint``.

    The header must hold one ``ip:port`` (Envoy 1.40 cannot parse a list there: 503 UH).
    infergate's EPP always sends one there, its primary pick, and puts the fallback list
    in the ``envoy.lb`` metadata, which this cluster does not read: no fallback on a
    failed connect here. It dials any address at all: safe here only because client
    copies of the header are stripped before ext_proc runs. Idle connections close before
    the engines close them, as in the EDS pool.
    """
    return {
        "name": POOL_CLUSTER,
        "type": "ORIGINAL_DST",
        "typed_extension_protocol_options": engine_protocol_options(http2=False),
        "connect_timeout": duration(connect_timeout_s),
        "lb_policy": "CLUSTER_PROVIDED",
        "circuit_breakers": circuit_breakers(max_requests),
        "original_dst_lb_config": {
            "use_http_header": True,
            "http_header_name": DESTINATION_HEADER,
        },
    }


def fallback_retry_policy(retries: int) -> dict[str, Any]:
    """Retries that walk the EPP's fallback list, for failures that leave no response.

    ``reset`` and not only ``reset-before-request``: an engine SIGKILLed keeps its
    sockets open while the kernel tears the process down, so a request written in that
    window, on a pooled connection or a fresh one, is reset after its bytes went out,
    which ``reset-before-request`` does not retry (Envoy counts the bytes as sent; 1 of
    455 requests sent after a kill failed so, 503 ``UC``). An HTTP/1.1 engine resets a
    request without answering only when its process dies, so the generation being
    redone elsewhere is one that can no longer finish; no retry happens once a response
    byte went downstream. ``previous_hosts`` keeps the least-request fallback off the
    hosts already tried, so a request is tried on at most ``retries + 1`` engines."""
    return {
        "retry_on": "connect-failure,refused-stream,reset",
        "num_retries": retries,
        "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"},
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": _PREVIOUS_HOSTS},
            }
        ],
        "host_selection_retry_max_attempts": 5,
    }


def _routes(
    *,
    route_timeout_s: float,
    has_fallback: bool,
    debug_headers: bool,
    fallback_retries: int,
    unpicked_to_pool: bool = True,
) -> list[dict[str, Any]]:
    route_action: dict[str, Any] = {
        "timeout": duration(route_timeout_s),
        # Streaming generations may idle between tokens; only a silent stream is cut.
        "idle_timeout": duration(max(route_timeout_s, 60.0)),
    }
    # Match on the EPP's dynamic metadata, which a client cannot forge (a header it could).
    picked = {
        "match": {
            "prefix": "/",
            "dynamic_metadata": [
                {
                    "filter": LB_METADATA_NAMESPACE,
                    "path": [{"key": DESTINATION_HEADER}],
                    "value": {"present_match": True},
                }
            ],
        },
        "route": {"cluster": POOL_CLUSTER, **route_action},
    }
    if fallback_retries > 0:
        # GIE: "if retry is configured, the proxy will go sequentially down the list".
        # Failures that leave no response: a connect that fails, or a reset before any
        # response byte (an engine that died; see fallback_retry_policy).
        # Once a retry has used up the EPP's list, override_host hands the choice to its
        # least-request fallback, which knows nothing of the failed tries: previous_hosts
        # keeps it off the hosts already tried (a SIGKILLed engine stays in EDS until the
        # EPP drops it, and was redialled before: issue 27 item 9).
        picked["route"]["retry_policy"] = fallback_retry_policy(fallback_retries)
    # No pick: the EPP was unreachable and failure_mode_allow let the request through.
    # An ORIGINAL_DST pool cannot take it (without the header it would dial the listener
    # itself): then such a request finds no route (404) unless a fallback cluster exists.
    routes: list[dict[str, Any]] = [picked]
    if has_fallback or unpicked_to_pool:
        cluster = FALLBACK_CLUSTER if has_fallback else POOL_CLUSTER
        routes.append({"match": {"prefix": "/"}, "route": {"cluster": cluster, **route_action}})
    for route in routes:
        # The served endpoint goes back to the EPP (header -> envoy.lb metadata, see
        # served_to_metadata_filter); the debug pair is for people and tests.
        headers = [header_value_option(SERVED_HEADER, "%UPSTREAM_HOST%")]
        if debug_headers:
            headers.append(header_value_option(UPSTREAM_HOST_HEADER, "%UPSTREAM_HOST%"))
            listed = f"%DYNAMIC_METADATA({LB_METADATA_NAMESPACE}:{DESTINATION_HEADER})%"
            headers.append(header_value_option(PICKED_HEADER, listed))
        route["response_headers_to_add"] = headers
    return routes


def served_to_metadata_filter() -> dict[str, Any]:
    """Copy the served endpoint into ``envoy.lb`` on the response path (before ext_proc
    sees the response headers), per GIE's protocol. The header stays: the EPP's answer
    sets it again to the same value, and a request whose response headers the EPP
    skipped (buffered bodies, every endpoint reporting records) keeps Envoy's."""
    return {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": _HEADER_TO_METADATA,
            "response_rules": [
                {
                    "header": SERVED_HEADER,
                    "on_header_present": {
                        "metadata_namespace": LB_METADATA_NAMESPACE,
                        "key": SERVED_HEADER,
                        "type": "STRING",
                    },
                    "remove": False,
                }
            ],
        },
    }


def _failure_mode_allow(text: str) -> bool:
    """``--failure-mode``: InferencePool's ``endpointPickerRef.failureMode`` → FailOpen?"""
    if text not in ("FailOpen", "FailClose"):
        raise ValueError(f"must be FailOpen or FailClose, not {text!r}")
    return text == "FailOpen"


def _one_of(allowed: Collection[str]) -> Callable[[str], str]:
    """A converter (the CLI's, and ``EnvoyConfig``'s own check) that takes only ``allowed``."""

    def convert(value: str) -> str:
        if value not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}, not {value!r}")
        return value

    return convert


_request_body_mode = _one_of(REQUEST_BODY_MODES)
_response_accounting = _one_of(RESPONSE_ACCOUNTING)
#: EnvoyConfig's fields that take one of a few names, checked when it is built.
_CHOICES = {
    "upstream": _one_of(UPSTREAMS),
    "response_accounting": _response_accounting,
    "request_body_mode": _request_body_mode,
}


@dataclass(frozen=True)
class EppMutualTls:
    """Files Envoy reads for mutual TLS with the EPP (``infergate.epp.server.tls``'s bundle):
    the CA that signed the EPP's certificate, Envoy's client pair, and the name the EPP's
    certificate must carry."""

    ca_file: str
    cert_file: str
    key_file: str
    server_name: str


@dataclass(frozen=True)
class EnvoyConfig:
    """What :func:`build_envoy_config` builds: one listener in front of an InferencePool.

    ``failure_mode_allow`` is the pool's ``failureMode`` (True = FailOpen). With FailOpen,
    requests the EPP could not handle are balanced (least-request) over
    ``fallback_endpoints`` when given, else over the endpoints the EPP last announced over
    EDS. ``admin_port=None`` disables the admin interface. ``epp_tls`` must match the
    EPP's ``--secure-serving``; a mismatch shows as an unhealthy EPP cluster (and
    FailOpen/FailClose applies), never as silent 500s.

    ``response_accounting`` is how the EPP learns the end of a response and its usage:

    * ``engine`` (default): the routing filter sees response headers only, no body, and
      Envoy closes its stream then; the engines publish a completion record per request
      (``--completion-events-port``, :mod:`infergate.wire.completions`). The
      EPP's cost is independent of the response's length and its death cuts no stream.
    * ``observer``: for engines that cannot report (vLLM): a second ext_proc filter in
      observability mode receives every response chunk, unanswered
      (:func:`_observer_filter`); the EPP reads ``usage`` from the body.
    * ``body``: GIE's single FULL_DUPLEX_STREAMED filter; every chunk through the EPP.
    * ``none``: no response body anywhere; no usage.

    ``upstream`` is how Envoy reaches the pick: ``eds`` (default; the pool cluster
    learns the endpoints from the EPP over EDS and honours its fallback list) or
    ``original_dst`` (GIE's reference ``ORIGINAL_DST`` cluster, for an EPP that serves
    no EDS; requests without a pick then get a 404 unless ``fallback_endpoints`` exist).
    """

    listen_port: int
    epp_address: str
    epp_port: int
    failure_mode_allow: bool = option(
        "--failure-mode",
        default=False,
        cli_type=str,
        cli_default="FailClose",
        convert=_failure_mode_allow,
        help="What Envoy does when the EPP is unreachable: FailClose (5xx) or FailOpen "
        "(serve from any engine), as InferencePool's endpointPickerRef.failureMode.",
    )
    fallback_endpoints: Sequence[tuple[str, int]] = ()
    fallback_retries: int = 3
    """Further endpoints of the EPP's list a request may try when one refuses the
    connection (0: none)."""
    response_accounting: str = option(
        "--response-accounting",
        default="engine",
        convert=_response_accounting,
        help="How the EPP learns each response's end and usage: engine (engines publish "
        "completion records over ZMQ; Envoy sends the EPP no response body), observer (an "
        "observability-mode filter streams response bodies to the EPP; for engines that "
        "cannot report), body (GIE's single filter) or none.",
    )
    upstream: str = "eds"
    request_body_mode: str = option(
        "--request-body-mode",
        default="streamed",
        convert=_request_body_mode,
        help="How Envoy hands request bodies to the EPP: streamed (GIE's "
        "FULL_DUPLEX_STREAMED: chunks as they arrive, each sent back by the EPP) or "
        "buffered (Envoy holds the whole body, up to 8 MiB, the EPP's default "
        "--max-request-body-bytes, sends it once and forwards it unchanged unless the EPP "
        "rewrote it: less CPU for long prompts, one round trip more for short ones, unless "
        "every engine reports completion records: then the EPP skips the response headers "
        "instead; past 8 MiB Envoy itself answers 413).",
    )
    max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES
    """With ``request_body_mode="buffered"``, the most Envoy buffers per request (the
    EPP's ``--max-request-body-bytes``, whose default this is)."""
    epp_tls: bool = False
    epp_mtls: EppMutualTls | None = None
    """Mutual TLS with the EPP (its ``--client-ca-file``): verify its certificate and
    present a client one; implies ``epp_tls``."""
    max_heap_bytes: int = ENVOY_MAX_HEAP_BYTES
    """The overload manager's heap bound (:func:`overload_manager`)."""
    epp_replicas: Sequence[tuple[str, int]] = ()
    """Further EPP replicas (host, port) beside ``epp_address``: the ext_proc cluster then
    has one endpoint per replica, ejects a replica at its first failed connection and
    retries a stream that could not open on another (:func:`_epp_replica_failover`)."""
    listen_address: str = "0.0.0.0"
    admin_port: int | None = 19000
    admin_address: str = "127.0.0.1"
    route_timeout_s: float = 300.0
    message_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    stream_idle_timeout_s: float = 300.0
    eds_initial_fetch_timeout_s: float = 5.0
    epp_health_check_interval_s: float | None = 1.0
    """gRPC health checks of the EPP (None: off); bounds how long after the EPP dies
    FailOpen starts to apply to requests with a body."""
    epp_replica_health_check_interval_s: float = 5.0
    """The same with ``epp_replicas``, where a replica that dies is not found by the health
    check: a stream that cannot open is retried on another replica, and the dead one is
    ejected at that first failure (:func:`_epp_replica_failover`). Active checks are left
    to find a replica that is alive but does not answer, at Envoy's usual pace; each check
    is a wakeup of every replica (~0.3 ms of CPU on a shared core), which at 1 s was the
    largest cost replicas add (docs/benchmarks/scale.md, "Replicas")."""
    epp_streams_per_connection: int = 100000
    """ext-proc streams Envoy multiplexes on one HTTP/2 connection to the EPP; past it
    Envoy opens another. A low value (e.g. 8) spreads load over several connections,
    which the kernel hands to different processes of an EPP run with ``--workers N``."""
    max_requests: int = 40000
    stat_prefix: str = "infergate"
    debug_headers: bool = False
    """Add :data:`UPSTREAM_HOST_HEADER` and :data:`PICKED_HEADER` to every response."""
    access_log: bool = option(
        "--access-log/--no-access-log", default=False, help="Envoy access log."
    )

    def __post_init__(self) -> None:
        if self.route_timeout_s <= 0:
            raise ValueError("route_timeout_s must be > 0")
        for name, check in _CHOICES.items():
            try:
                check(getattr(self, name))
            except ValueError as error:
                raise ValueError(f"{name} {error}") from None

    @property
    def epp_authority(self) -> str:
        return f"{self.epp_address}:{self.epp_port}"


def build_envoy_config(config: EnvoyConfig) -> dict[str, Any]:
    """Envoy's v3 bootstrap (as dicts) for ``config``."""
    bootstrap: dict[str, Any] = {
        "node": {"id": f"{config.stat_prefix}-envoy", "cluster": config.stat_prefix},
        "static_resources": {
            "listeners": [
                {
                    "name": f"{config.stat_prefix}_listener",
                    "address": socket_address(config.listen_address, config.listen_port),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": _http_connection_manager(config),
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": _clusters(config),
        },
        "overload_manager": overload_manager(config.max_heap_bytes),
    }
    if config.admin_port is not None:
        bootstrap["admin"] = {"address": socket_address(config.admin_address, config.admin_port)}
    return bootstrap


def _body_buffer_limit(config: EnvoyConfig) -> dict[str, Any]:
    """Buffered, Envoy holds each request's body until the EPP answers: its per-request
    limit (1 MiB by default) must be the EPP's, or longer prompts would get Envoy's 413."""
    if config.request_body_mode != "buffered":
        return {}
    return {"per_request_buffer_limit_bytes": config.max_request_body_bytes}


def _http_connection_manager(config: EnvoyConfig) -> dict[str, Any]:
    """The listener's HTTP pipeline: strip client copies of the routing headers, ext_proc
    to the EPP (plus the observer when it accounts responses), routes to the pool."""
    hcm: dict[str, Any] = {
        "@type": _HCM,
        "stat_prefix": config.stat_prefix,
        "codec_type": "AUTO",
        # Generations stream for minutes: no whole-request deadline, only an idle one.
        "request_timeout": "0s",
        "stream_idle_timeout": duration(config.stream_idle_timeout_s),
        "request_headers_timeout": "10s",
        "common_http_protocol_options": {"idle_timeout": "3600s"},
        "use_remote_address": True,
        "normalize_path": True,
        "merge_slashes": True,
        "route_config": {
            "name": f"{config.stat_prefix}_routes",
            "virtual_hosts": [
                {
                    "name": "inference_pool",
                    "domains": ["*"],
                    **_body_buffer_limit(config),
                    "routes": _routes(
                        route_timeout_s=config.route_timeout_s,
                        has_fallback=bool(config.fallback_endpoints),
                        fallback_retries=config.fallback_retries,
                        debug_headers=config.debug_headers,
                        unpicked_to_pool=config.upstream == "eds",
                    ),
                }
            ],
        },
        "http_filters": [
            strip_client_headers_filter(),
            ext_proc_filter(
                failure_mode_allow=config.failure_mode_allow,
                message_timeout_s=config.message_timeout_s,
                grpc_authority=config.epp_authority,
                response_bodies=config.response_accounting == "body",
                request_body_mode=config.request_body_mode,
            ),
            *(
                [_observer_filter(grpc_authority=config.epp_authority)]
                if config.response_accounting == "observer"
                else []
            ),
            served_to_metadata_filter(),
            {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}},
        ],
    }
    if config.epp_replicas:
        for http_filter in hcm["http_filters"]:
            service = http_filter.get("typed_config", {}).get("grpc_service")
            if service is not None:
                service["retry_policy"] = EPP_STREAM_RETRY
    if config.access_log:
        hcm["access_log"] = [
            {
                "name": "envoy.access_loggers.stdout",
                "typed_config": {
                    "@type": _STDOUT_LOG,
                    "log_format": {"text_format_source": {"inline_string": _ACCESS_LOG_FORMAT}},
                },
            }
        ]
    return hcm


def _clusters(config: EnvoyConfig) -> list[dict[str, Any]]:
    """The EPP, the pool (EDS or ORIGINAL_DST) and, when given, the static fallback."""
    if config.upstream == "original_dst":
        pool_cluster = _original_dst_cluster(
            connect_timeout_s=config.connect_timeout_s, max_requests=config.max_requests
        )
    else:
        pool_cluster = _pool_cluster(
            connect_timeout_s=config.connect_timeout_s,
            max_requests=config.max_requests,
            initial_fetch_timeout_s=config.eds_initial_fetch_timeout_s,
        )
    clusters = [_epp_cluster(config), pool_cluster]
    if config.fallback_endpoints:
        fallback = _static_cluster(
            FALLBACK_CLUSTER,
            list(config.fallback_endpoints),
            connect_timeout_s=config.connect_timeout_s,
            max_requests=config.max_requests,
            # The same engines as the pool: close idle connections before they do (a
            # request written as an engine closes one fails 503 "connection termination",
            # not retried; the routing lab's least-request row lost one so, 2026-12-07).
            protocol_options=engine_protocol_options(http2=False),
        )
        clusters.append(fallback)
    return clusters


def _epp_cluster(config: EnvoyConfig) -> dict[str, Any]:
    """HTTP/2 to the EPP, health-checked over the ext-proc transport, TLS when it serves it."""
    cluster = _static_cluster(
        EPP_CLUSTER,
        [(config.epp_address, config.epp_port), *config.epp_replicas],
        connect_timeout_s=config.connect_timeout_s,
        max_requests=config.max_requests,
        protocol_options=grpc_protocol_options(config.epp_streams_per_connection),
    )
    if config.epp_health_check_interval_s is not None:
        cluster.update(
            epp_health_checks(
                config.epp_replica_health_check_interval_s
                if config.epp_replicas
                else config.epp_health_check_interval_s,
                # On the ext-proc port, over the same transport as ext-proc (see above).
                {"grpc_health_check": {"service_name": EPP_HEALTH_SERVICE}},
            )
        )
    if config.epp_replicas:
        cluster.update(_epp_replica_failover())
    if config.epp_tls or config.epp_mtls is not None:
        cluster["transport_socket"] = epp_tls_transport_socket(
            None if is_ip(config.epp_address) else config.epp_address, config.epp_mtls
        )
    return cluster


def epp_health_checks(interval_s: float, check: dict[str, Any]) -> dict[str, Any]:
    """Active health checking of an EPP cluster (``check``: Envoy's ``grpc_health_check``
    or ``tcp_health_check``), with panic routing off.

    With FULL_DUPLEX_STREAMED bodies Envoy can fail open only until the first body chunk
    went to the EPP; a dead EPP found at connect time is already too late for a POST. A
    health-checked EPP with no healthy host fails the gRPC stream at once, in the headers
    phase, where failure_mode_allow still applies. Panic routing (Envoy's "use unhealthy
    hosts anyway" below 50% healthy) would defeat that."""
    interval = duration(interval_s)
    return {
        "health_checks": [
            {
                "timeout": duration(min(1.0, interval_s)),
                "interval": interval,
                "no_traffic_interval": interval,
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                **check,
            }
        ],
        "common_lb_config": {"healthy_panic_threshold": {"value": 0.0}},
    }


def epp_tls_transport_socket(sni: str | None, mutual: EppMutualTls | None = None) -> dict[str, Any]:
    """TLS toward an EPP serving ``--secure-serving``.

    Without ``mutual``, like GIE's gateways, it does not verify the certificate
    (self-signed by default). With it, Envoy checks the EPP's certificate against the CA
    and its name (SAN and SNI ``mutual.server_name``) and presents its own client
    certificate, which an EPP run with ``--client-ca-file`` requires. ext-proc, EDS and
    the health checks share this cluster, so all three go over the same mutual TLS.
    """
    context: dict[str, Any] = {"alpn_protocols": ["h2"]}
    if mutual is not None:
        sni = mutual.server_name
        context["tls_certificates"] = [
            {
                "certificate_chain": {"filename": mutual.cert_file},
                "private_key": {"filename": mutual.key_file},
            }
        ]
        context["validation_context"] = {
            "trusted_ca": {"filename": mutual.ca_file},
            "match_typed_subject_alt_names": [
                {"san_type": "DNS", "matcher": {"exact": mutual.server_name}}
            ],
        }
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": _UPSTREAM_TLS,
            "common_tls_context": context,
            **({} if sni is None else {"sni": sni}),
        },
    }


def overload_manager(max_heap_bytes: int, max_connections: int = 50_000) -> dict[str, Any]:
    """Envoy's overload manager: a heap bound that holds, and a downstream connection cap.

    Why: a flood of large bodies (each held until the EPP answers) grows Envoy's heap,
    and tcmalloc keeps what it freed. At :data:`SHRINK_HEAP_AT` of ``max_heap_bytes``
    Envoy hands free heap back to the kernel; at :data:`STOP_REQUESTS_AT` it answers new
    requests 503 at once rather than grow into the container's OOM kill. The connection
    cap also quiets Envoy's "no overload manager" warning.
    """
    if max_heap_bytes <= 0:
        raise ValueError(f"max_heap_bytes must be > 0, got {max_heap_bytes}")

    def action(name: str, threshold: float) -> dict[str, Any]:
        trigger = {"name": _FIXED_HEAP, "threshold": {"value": threshold}}
        return {"name": name, "triggers": [trigger]}

    return {
        "refresh_interval": "0.25s",
        "resource_monitors": [
            {
                "name": _FIXED_HEAP,
                "typed_config": {
                    "@type": _T + "extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
                    "max_heap_size_bytes": max_heap_bytes,
                },
            },
            {
                "name": "envoy.resource_monitors.global_downstream_max_connections",
                "typed_config": {
                    "@type": _T
                    + "extensions.resource_monitors.downstream_connections.v3."
                    + "DownstreamConnectionsConfig",
                    "max_active_downstream_connections": max_connections,
                },
            },
        ],
        "actions": [
            action("envoy.overload_actions.shrink_heap", SHRINK_HEAP_AT),
            action("envoy.overload_actions.stop_accepting_requests", STOP_REQUESTS_AT),
        ],
    }


def render_envoy_yaml(config: EnvoyConfig) -> str:
    """:func:`build_envoy_config` rendered as YAML (what ``envoy -c`` reads)."""
    return yaml.safe_dump(build_envoy_config(config), sort_keys=False)
