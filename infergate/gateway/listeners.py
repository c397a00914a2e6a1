"""Gateway listeners: validation, conflicts, route admission, status, Envoy listeners.

Only ``HTTP`` listeners are served. Every port with at least one usable listener becomes
one Envoy listener on ``0.0.0.0:<port>`` whose HTTP connection manager takes its routes
over RDS (route configuration ``http-<port>``) from the same ADS stream: a route change
is an RDS update and never touches the listener, so streams in flight are not drained.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from infergate.envoy import bootstrap as envoy
from infergate.gateway import conditions as c
from infergate.gateway import hostnames
from infergate.gateway.model import (
    GATEWAY_KIND,
    HTTPROUTE_KIND,
    as_dict,
    as_int,
    as_list,
    as_str,
    meta,
    selector_matches,
    selector_valid,
    valid_port,
)
from infergate.gateway.options import TranslateOptions
from infergate.gateway.types import GATEWAY_GROUP, Obj

HTTP = "HTTP"
HTTPROUTE_GROUP_KIND = {"group": GATEWAY_GROUP, "kind": HTTPROUTE_KIND}
#: The ext_proc filter's default service; the filter is disabled unless a route enables
#: it with an override naming its pool's EPP cluster, so nothing ever dials this name.
EXT_PROC_UNSET_CLUSTER = "ext-proc-unset"

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_STDOUT_LOG = "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"


@dataclass
class Listener:
    """One ``spec.listeners[]`` entry and what the translator decided about it."""

    name: str
    port: int
    protocol: str
    hostname: str
    namespaces_from: str
    namespace_selector: Any
    kinds: list[dict[str, str]] = field(default_factory=list)
    invalid_kinds: bool = False
    problem: c.Condition | None = None
    conflict: str | None = None
    attached: int = 0

    @property
    def usable(self) -> bool:
        """Accepted and not conflicted: it gets Envoy config and routes."""
        return self.problem is None and self.conflict is None

    def allows(self, route_namespace: str, gateway_namespace: str, ns_labels: Any) -> bool:
        """allowedRoutes.namespaces for an HTTPRoute in ``route_namespace``."""
        if not self.kinds:
            return False
        if self.namespaces_from == "All":
            return True
        if self.namespaces_from == "Selector":
            labels = ns_labels.get(route_namespace)
            return labels is not None and bool(selector_matches(self.namespace_selector, labels))
        return route_namespace == gateway_namespace


def parse_listeners(gateway: Obj) -> list[Listener]:
    """The Gateway's listeners (named, first of each name), validated and with conflicts."""
    out: list[Listener] = []
    seen: set[str] = set()
    for raw in as_list(as_dict(gateway.get("spec")).get("listeners")):
        listener = _parse_listener(as_dict(raw))
        if listener.name and listener.name not in seen:
            seen.add(listener.name)
            out.append(listener)
    _mark_conflicts(out)
    return out


def _parse_listener(raw: dict[str, Any]) -> Listener:
    allowed = as_dict(as_dict(raw.get("allowedRoutes")).get("namespaces"))
    port = as_int(raw.get("port"))
    listener = Listener(
        name=as_str(raw.get("name")),
        port=port if port is not None and valid_port(port) else 0,
        protocol=as_str(raw.get("protocol")),
        hostname=as_str(raw.get("hostname")) or hostnames.ANY,
        namespaces_from=as_str(allowed.get("from"), "Same"),
        namespace_selector=allowed.get("selector"),
    )
    _route_kinds(listener, raw)
    listener.problem = _listener_problem(listener, raw)
    return listener


def _route_kinds(listener: Listener, raw: dict[str, Any]) -> None:
    """supportedKinds: HTTPRoute on HTTP listeners; anything else asked for is invalid."""
    supported = listener.protocol == HTTP
    wanted = as_list(as_dict(raw.get("allowedRoutes")).get("kinds"))
    if not wanted:
        listener.kinds = [dict(HTTPROUTE_GROUP_KIND)] if supported else []
        return
    for kind in map(as_dict, wanted):
        group = as_str(kind.get("group"), GATEWAY_GROUP)
        if supported and group == GATEWAY_GROUP and kind.get("kind") == HTTPROUTE_KIND:
            if not listener.kinds:
                listener.kinds.append(dict(HTTPROUTE_GROUP_KIND))
        else:
            listener.invalid_kinds = True


def _listener_problem(listener: Listener, raw: dict[str, Any]) -> c.Condition | None:
    """Why the listener cannot be accepted, as its Accepted=False condition."""
    if listener.protocol != HTTP:
        return c.false(
            c.ACCEPTED,
            c.UNSUPPORTED_PROTOCOL,
            f"protocol {listener.protocol!r} is not supported; only HTTP is",
        )
    if not listener.port:
        return c.false(c.ACCEPTED, c.PORT_UNAVAILABLE, f"invalid port {raw.get('port')!r}")
    if listener.hostname != hostnames.ANY and not hostnames.valid(listener.hostname):
        return c.false(c.ACCEPTED, c.UNSUPPORTED_VALUE, f"invalid hostname {listener.hostname!r}")
    if listener.namespaces_from not in ("All", "Same", "Selector"):
        return c.false(
            c.ACCEPTED, c.UNSUPPORTED_VALUE, f"unknown namespaces.from {listener.namespaces_from!r}"
        )
    if listener.namespaces_from == "Selector" and not selector_valid(listener.namespace_selector):
        return c.false(c.ACCEPTED, c.UNSUPPORTED_VALUE, "invalid allowedRoutes namespace selector")
    return None


def _mark_conflicts(listeners: list[Listener]) -> None:
    """Listeners sharing a port with another protocol, or port, protocol and hostname
    with another listener, are Conflicted; none of them is served (no winner is picked)."""
    protocols: dict[int, set[str]] = {}
    for listener in listeners:
        protocols.setdefault(listener.port, set()).add(listener.protocol)
    distinct = Counter((x.port, x.protocol, x.hostname) for x in listeners)
    for listener in listeners:
        if len(protocols[listener.port]) > 1:
            listener.conflict = c.PROTOCOL_CONFLICT
        elif distinct[(listener.port, listener.protocol, listener.hostname)] > 1:
            listener.conflict = c.HOSTNAME_CONFLICT


def listener_conditions(listener: Listener, programmed: bool) -> list[c.Condition]:
    """Accepted, Conflicted, ResolvedRefs and Programmed, with the spec's reasons."""
    if listener.problem is not None:
        accepted = listener.problem
    elif listener.conflict is not None:
        accepted = c.false(c.ACCEPTED, listener.conflict, "conflicts with another listener")
    else:
        accepted = c.true(c.ACCEPTED, c.ACCEPTED, "listener accepted")
    conflicted = (
        c.true(c.CONFLICTED, listener.conflict, _conflict_message(listener.conflict))
        if listener.conflict
        else c.false(c.CONFLICTED, c.NO_CONFLICTS, "no conflicts")
    )
    resolved = (
        c.false(c.RESOLVED_REFS, c.INVALID_ROUTE_KINDS, "only HTTPRoute is supported")
        if listener.invalid_kinds
        else c.true(c.RESOLVED_REFS, c.RESOLVED_REFS, "references resolved")
    )
    if not listener.usable:
        done = c.false(c.PROGRAMMED, c.INVALID, "listener is not accepted")
    elif programmed:
        done = c.true(c.PROGRAMMED, c.PROGRAMMED, "listener is programmed")
    else:
        done = c.false(c.PROGRAMMED, c.PENDING, "waiting for the gateway's proxies")
    return [accepted, conflicted, resolved, done]


def _conflict_message(reason: str) -> str:
    if reason == c.PROTOCOL_CONFLICT:
        return "another listener uses the same port with a different protocol"
    return "another listener uses the same port, protocol and hostname"


def listener_status(listener: Listener, programmed: bool, previous: Any, gen: int, now: str) -> Obj:
    """One ``status.listeners[]`` entry."""
    return {
        "name": listener.name,
        "supportedKinds": [dict(k) for k in listener.kinds],
        "attachedRoutes": listener.attached,
        "conditions": c.render(listener_conditions(listener, programmed), previous, gen, now),
    }


def previous_listener_conditions(gateway: Obj, name: str) -> Any:
    """The current status conditions of the listener called ``name`` (for transition times)."""
    for entry in as_list(as_dict(gateway.get("status")).get("listeners")):
        if as_dict(entry).get("name") == name:
            return as_dict(entry).get("conditions")
    return None


def route_config_name(port: int) -> str:
    return f"http-{port}"


def envoy_listener(port: int, options: TranslateOptions) -> Obj:
    """The Envoy listener of one Gateway port: its HCM takes routes over RDS (ADS)."""
    return {
        "name": route_config_name(port),
        "address": envoy.socket_address(options.listen_address, port),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": _connection_manager(port, options),
                    }
                ]
            }
        ],
    }


def _connection_manager(port: int, options: TranslateOptions) -> Obj:
    """The HTTP pipeline: strip client copies of the routing headers, ext_proc (off
    unless a route to an InferencePool turns it on for its EPP), served endpoint to the
    EPP, router. Constant per port, so route and pool changes never rebuild it."""
    hcm: Obj = {
        "@type": _HCM,
        "stat_prefix": route_config_name(port),
        "codec_type": "AUTO",
        "rds": {
            "config_source": {"ads": {}, "resource_api_version": "V3"},
            "route_config_name": route_config_name(port),
        },
        # Generations stream for minutes: no whole-request deadline, only an idle one.
        "request_timeout": "0s",
        "stream_idle_timeout": envoy.duration(options.stream_idle_timeout_s),
        "request_headers_timeout": "10s",
        "common_http_protocol_options": {"idle_timeout": "3600s"},
        "use_remote_address": True,
        "normalize_path": True,
        "merge_slashes": True,
        # Gateway API matches hostnames ignoring the Host header's port.
        "strip_any_host_port": True,
        "upgrade_configs": [{"upgrade_type": "websocket"}],
        "http_filters": [
            envoy.strip_client_headers_filter(),
            _ext_proc_filter(options),
            envoy.served_to_metadata_filter(),
            {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}},
        ],
    }
    if options.access_log:
        hcm["access_log"] = [_access_log()]
    return hcm


def _ext_proc_filter(options: TranslateOptions) -> Obj:
    """GIE's ext_proc filter, disabled by default: each route to a pool enables it with
    an ``ExtProcPerRoute`` override naming that pool's EPP and failure mode. The route
    chosen before the EPP answers is kept (``RETAIN``): a header the EPP sets can never
    move a request onto another rule, hence another pool."""
    http_filter = envoy.ext_proc_filter(
        failure_mode_allow=False,
        message_timeout_s=options.message_timeout_s,
        grpc_authority=EXT_PROC_UNSET_CLUSTER,
        response_bodies=options.response_bodies,
        cluster_name=EXT_PROC_UNSET_CLUSTER,
    )
    http_filter["typed_config"]["route_cache_action"] = "RETAIN"
    http_filter["disabled"] = True
    return http_filter


def _access_log() -> Obj:
    fmt = (
        '[%START_TIME%] "%REQ(:METHOD)% %REQ(:AUTHORITY)%%REQ(:PATH)%" %RESPONSE_CODE% '
        "%RESPONSE_FLAGS% route=%ROUTE_NAME% cluster=%UPSTREAM_CLUSTER% "
        "upstream=%UPSTREAM_HOST% duration_ms=%DURATION%\n"
    )
    return {
        "name": "envoy.access_loggers.stdout",
        "typed_config": {
            "@type": _STDOUT_LOG,
            "log_format": {"text_format_source": {"inline_string": fmt}},
        },
    }


def gateway_problem(gateway: Obj) -> c.Condition | None:
    """Gateway-level reasons not to accept it: static addresses and infrastructure
    parameters are not supported."""
    spec = as_dict(gateway.get("spec"))
    if as_list(spec.get("addresses")):
        return c.false(
            c.ACCEPTED,
            c.UNSUPPORTED_ADDRESS,
            "spec.addresses is not supported: the address comes from the gateway's Service",
        )
    if as_dict(spec.get("infrastructure")).get("parametersRef") is not None:
        return c.false(
            c.ACCEPTED, c.INVALID_PARAMETERS, "infrastructure.parametersRef is not supported"
        )
    return None


def gateway_conditions(
    problem: c.Condition | None, listeners: list[Listener], programmed: bool
) -> list[c.Condition]:
    """The Gateway's Accepted and Programmed conditions."""
    bad = [x.name for x in listeners if not x.usable]
    if problem is not None:
        accepted = problem
    elif not any(x.usable for x in listeners):
        accepted = c.false(c.ACCEPTED, c.LISTENERS_NOT_VALID, "no valid listener")
    elif bad:
        accepted = c.true(c.ACCEPTED, c.LISTENERS_NOT_VALID, f"invalid listeners: {bad}")
    else:
        accepted = c.true(c.ACCEPTED, c.ACCEPTED, "gateway accepted")
    if accepted.status != "True":
        done = c.false(c.PROGRAMMED, c.INVALID, "gateway is not accepted")
    elif programmed:
        done = c.true(c.PROGRAMMED, c.PROGRAMMED, "gateway is programmed")
    else:
        done = c.false(c.PROGRAMMED, c.PENDING, "waiting for the gateway's proxies")
    return [accepted, done]


def status_addresses(addresses: Any) -> list[Obj]:
    """``status.addresses`` from the proxies' Service addresses."""
    out = []
    for value in addresses or ():
        if isinstance(value, str) and value:
            kind = "IPAddress" if envoy.is_ip(value) else "Hostname"
            out.append({"type": kind, "value": value})
    return out


def namespace_labels(namespaces: Any) -> Mapping[str, Mapping[str, str]]:
    """Namespace name → labels (for allowedRoutes selectors)."""
    return {meta(ns).name: meta(ns).labels for ns in namespaces if meta(ns).name}


def is_gateway_ref(ref: dict[str, Any]) -> bool:
    """A parentRef naming a Gateway (group and kind default to Gateway's)."""
    return (
        as_str(ref.get("group"), GATEWAY_GROUP) == GATEWAY_GROUP
        and as_str(ref.get("kind"), GATEWAY_KIND) == GATEWAY_KIND
    )
