"""HTTPRoutes: compiled rules, attachment to listeners, and per-port route tables.

A rule that cannot be programmed as written (an unsupported filter or match type, a bad
regex, a reserved header) stays in the table and answers 500 for what it matches: the
spec forbids skipping a filter, and dropping the rule would let its requests fall
through to some other rule, hence another backend. Rules whose backends are all invalid
answer 500 as well.

Route precedence follows Gateway API: per virtual host, rules of routes with a more
specific matching hostname first, then the match precedence of
:mod:`infergate.gateway.matches`, then the oldest route, then ``namespace/name``, then
rule and match order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from infergate.envoy import bootstrap as envoy
from infergate.gateway import conditions as c
from infergate.gateway import hostnames
from infergate.gateway.backends import (
    EXT_PROC_FILTER,
    INVALID_BACKEND_CLUSTER,
    Backend,
    Catalog,
)
from infergate.gateway.filters import (
    Headers,
    RuleFilters,
    compile_backend_filters,
    compile_rule_filters,
    redirect_port,
)
from infergate.gateway.listeners import Listener
from infergate.gateway.matches import Invalid, Match, compile_match, parse_duration
from infergate.gateway.model import Meta, as_dict, as_list, meta
from infergate.gateway.options import TranslateOptions
from infergate.gateway.types import Key, Obj
from infergate.wire.names import SERVED_HEADER

_PARENT_REF_FIELDS = ("group", "kind", "namespace", "name", "sectionName", "port")


@dataclass
class Rule:
    """One compiled ``spec.rules[]`` entry."""

    index: int
    matches: list[Match]
    backends: list[Backend]
    backend_headers: list[Headers] = field(default_factory=list)
    filters: RuleFilters = field(default_factory=RuleFilters)
    timeout: float | None = None
    backend_timeout: float | None = None
    problem: str | None = None


@dataclass
class Route:
    """One compiled HTTPRoute."""

    obj: Obj
    meta: Meta
    hostnames: list[str]
    hostnames_valid: bool
    rules: list[Rule]

    @property
    def usable(self) -> bool:
        """At least one valid rule: the route can be accepted."""
        return any(r.problem is None for r in self.rules)

    def invalid_rules(self) -> list[Rule]:
        return [r for r in self.rules if r.problem is not None]

    def ref_problems(self) -> list[tuple[str, str]]:
        return [b.problem for r in self.rules for b in r.backends if b.problem is not None]


def compile_route(obj: Obj, catalog: Catalog) -> Route:
    """An HTTPRoute with every rule compiled and every backendRef resolved."""
    m = meta(obj)
    spec = as_dict(obj.get("spec"))
    raw_hosts = [h for h in as_list(spec.get("hostnames")) if isinstance(h, str)]
    valid_hosts = [h for h in raw_hosts if hostnames.valid(h)]
    rules = as_list(spec.get("rules")) or [{}]
    return Route(
        obj=obj,
        meta=m,
        hostnames=valid_hosts,
        hostnames_valid=bool(valid_hosts) or not as_list(spec.get("hostnames")),
        rules=[_compile_rule(i, as_dict(r), m.namespace, catalog) for i, r in enumerate(rules)],
    )


def _compile_rule(index: int, raw: dict[str, Any], namespace: str, catalog: Catalog) -> Rule:
    refs = as_list(raw.get("backendRefs"))
    rule = Rule(index, [], [catalog.resolve(namespace, ref) for ref in refs])
    problems = []
    raw_matches = as_list(raw.get("matches")) or [{}]
    for match in raw_matches:
        try:
            rule.matches.append(compile_match(as_dict(match)))
        except Invalid as error:
            problems.append(str(error))
    prefix = rule.matches[0].prefix if len(raw_matches) == 1 and rule.matches else None
    try:
        rule.filters = compile_rule_filters(raw.get("filters"), prefix, len(raw_matches) == 1)
        rule.backend_headers = [compile_backend_filters(list(b.filters)) for b in rule.backends]
        _timeouts(rule, as_dict(raw.get("timeouts")))
    except Invalid as error:
        problems.append(str(error))
    if problems:
        rule.problem = "; ".join(problems)
    return rule


def _timeouts(rule: Rule, timeouts: dict[str, Any]) -> None:
    if "request" in timeouts:
        rule.timeout = parse_duration(timeouts["request"])
    if "backendRequest" in timeouts:
        rule.backend_timeout = parse_duration(timeouts["backendRequest"])
    if rule.timeout and rule.backend_timeout and rule.backend_timeout > rule.timeout:
        raise Invalid("backendRequest timeout exceeds the request timeout")


# --- attachment -------------------------------------------------------------------


@dataclass
class Attachment:
    """A route attached to one listener, with the hostnames it serves there."""

    listener: Listener
    route: Route
    hostnames: list[str]


def parent_ref(raw: dict[str, Any]) -> Obj:
    """A parentRef as echoed into ``status.parents[].parentRef``."""
    return {k: raw[k] for k in _PARENT_REF_FIELDS if raw.get(k) is not None}


def attach(
    route: Route,
    ref: dict[str, Any],
    listeners: list[Listener],
    gateway_namespace: str,
    ns_labels: Any,
) -> tuple[c.Condition, list[Attachment]]:
    """Attach a route to the listeners one parentRef selects; the Accepted condition."""
    section = ref.get("sectionName")
    port = ref.get("port")
    candidates = [
        x
        for x in listeners
        if (section is None or x.name == section) and (port is None or x.port == port)
    ]
    if not candidates:
        return c.false(c.ACCEPTED, c.NO_MATCHING_PARENT, "no listener matches the parentRef"), []
    allowed = [
        x for x in candidates if x.allows(route.meta.namespace, gateway_namespace, ns_labels)
    ]
    if not allowed:
        message = "the listeners' allowedRoutes do not admit this route"
        return c.false(c.ACCEPTED, c.NOT_ALLOWED_BY_LISTENERS, message), []
    attached = []
    for listener in allowed:
        served = hostnames.effective(listener.hostname, route.hostnames)
        if served and route.hostnames_valid:
            attached.append(Attachment(listener, route, served))
    if not attached:
        message = "no listener hostname intersects the route's hostnames"
        return c.false(c.ACCEPTED, c.NO_MATCHING_LISTENER_HOSTNAME, message), []
    if not route.usable:
        message = "no rule can be programmed: " + _rule_problems(route)
        return c.false(c.ACCEPTED, c.UNSUPPORTED_VALUE, message), []
    return c.true(c.ACCEPTED, c.ACCEPTED, "route accepted"), attached


def route_conditions(route: Route, accepted: c.Condition) -> list[c.Condition]:
    """Accepted, ResolvedRefs and (only when some rules are invalid) PartiallyInvalid."""
    problems = route.ref_problems()
    if problems:
        message = "; ".join(m for _, m in problems)
        resolved = c.false(c.RESOLVED_REFS, problems[0][0], message)
    else:
        resolved = c.true(c.RESOLVED_REFS, c.RESOLVED_REFS, "references resolved")
    out = [accepted, resolved]
    if accepted.status == "True" and route.invalid_rules():
        message = "Dropped Rule(s): " + _rule_problems(route) + " (requests they match get 500)"
        out.append(c.true(c.PARTIALLY_INVALID, c.UNSUPPORTED_VALUE, message))
    return out


def _rule_problems(route: Route) -> str:
    return "; ".join(f"rule {r.index}: {r.problem}" for r in route.invalid_rules())


# --- route tables -----------------------------------------------------------------


def route_configuration(
    name: str,
    port: int,
    listeners: list[Listener],
    attachments: list[Attachment],
    options: TranslateOptions,
    shadowed: dict[Key, list[str]] | None = None,
) -> Obj:
    """One port's RouteConfiguration: a virtual host per hostname, each holding the
    rules of the listener that hostname belongs to (listener isolation).

    ``shadowed`` collects, per HTTPRoute, the matches another route serves: two routes
    with the same match on the same host are both accepted (the spec says so), and
    precedence gives the match to the older one; the other's owner learns it from a
    condition instead of from traffic that never arrives."""
    by_hostname: dict[str, list[Attachment]] = {}
    for att in attachments:
        for host in att.hostnames:
            by_hostname.setdefault(host, []).append(att)
    domains = set(by_hostname) | {x.hostname for x in listeners}
    virtual_hosts = []
    for domain in sorted(domains, key=lambda d: (hostnames.specificity(d), d), reverse=True):
        owner = _owning_listener(domain, listeners)
        if owner is None:
            continue
        entries = _vhost_entries(domain, owner, by_hostname)
        if shadowed is not None:
            _note_shadowed(domain, entries, shadowed)
        routes = [
            _envoy_route(att.route, rule, j, m, port, options) for _, att, rule, j, m in entries
        ]
        virtual_hosts.append({"name": domain, "domains": [domain], "routes": routes})
    return {"name": name, "virtual_hosts": virtual_hosts}


def _note_shadowed(domain: str, entries: list[Any], shadowed: dict[Key, list[str]]) -> None:
    """Record each match that an earlier entry (higher precedence) of another route has
    exactly: Envoy takes the first, so the later one never sees a request."""
    first: dict[str, Route] = {}
    for _, att, rule, j, match in entries:
        ident = json.dumps(match.envoy, sort_keys=True)
        winner = first.setdefault(ident, att.route)
        if winner is not att.route:
            w = winner.meta
            shadowed.setdefault(att.route.meta.key, []).append(
                f"rule {rule.index} match {j} on {domain} is served by HTTPRoute "
                f"{w.namespace}/{w.name}, which has the same match and precedence"
            )


def _owning_listener(domain: str, listeners: list[Listener]) -> str | None:
    """The hostname of the most specific listener covering ``domain``."""
    covering = [x.hostname for x in listeners if hostnames.covers(x.hostname, domain)]
    return max(covering, key=hostnames.specificity) if covering else None


def _vhost_entries(domain: str, owner: str, by_hostname: dict[str, list[Attachment]]) -> list[Any]:
    """(sort key, attachment, rule, match index, match) for every rule match served at
    ``domain``, in Gateway API precedence order."""
    entries = []
    seen = set()
    candidates = {id(a): a for h in hostnames.covering(domain) for a in by_hostname.get(h, ())}
    for att in candidates.values():
        if att.listener.hostname != owner:
            continue
        covering = [h for h in att.hostnames if hostnames.covers(h, domain)]
        host_rank = max(hostnames.route_precedence(h) for h in covering)
        m = att.route.meta
        for rule in att.route.rules:
            for j, match in enumerate(rule.matches):
                ident = (m.namespace, m.name, rule.index, j)
                if ident in seen:
                    continue
                seen.add(ident)
                key = (
                    (-host_rank[0], -host_rank[1]),
                    match.precedence,
                    m.created or "~",
                    f"{m.namespace}/{m.name}",
                    rule.index,
                    j,
                )
                entries.append((key, att, rule, j, match))
    entries.sort(key=lambda e: e[0])
    return entries


def _envoy_route(
    route: Route, rule: Rule, j: int, match: Match, port: int, options: TranslateOptions
) -> Obj:
    m = route.meta
    out: Obj = {
        "name": f"{m.namespace}/{m.name}/rule/{rule.index}/match/{j}",
        "match": match.envoy,
    }
    if rule.problem is not None:
        out["direct_response"] = {"status": 500}
        return out
    rule.filters.headers.apply(out)
    if rule.filters.redirect is not None:
        out["redirect"] = redirect_port(rule.filters.redirect, port)
        return out
    action = _route_action(rule, options, out)
    if action is None:
        out["direct_response"] = {"status": 500}
    else:
        out["route"] = action
    return out


def _route_action(rule: Rule, options: TranslateOptions, route: Obj) -> Obj | None:
    """Envoy RouteAction for the rule's backends; None when none can take traffic."""
    live = [
        (b, h) for b, h in zip(rule.backends, rule.backend_headers, strict=False) if b.weight > 0
    ]
    if not live or all(b.cluster is None for b, _ in live):
        return None
    timeout = options.route_timeout_s if rule.timeout is None else rule.timeout
    action: Obj = {
        "timeout": envoy.duration(timeout),
        # Streaming generations may idle between tokens; only a silent stream is cut.
        "idle_timeout": envoy.duration(max(options.route_timeout_s, 60.0)),
    }
    (only, headers), single = live[0], len(live) == 1
    if single and only.cluster is not None and not _has_headers(headers):
        action["cluster"] = only.cluster
        _served_extras(only, route)
    else:
        action["weighted_clusters"] = {"clusters": [_cluster_weight(b, h) for b, h in live]}
        action["cluster_not_found_response_code"] = "INTERNAL_SERVER_ERROR"
    if any(b.served for b, _ in live) and options.fallback_retries > 0:
        action["retry_policy"] = envoy.fallback_retry_policy(options.fallback_retries)
    if rule.backend_timeout is not None:
        retry = action.setdefault("retry_policy", {"num_retries": 0})
        retry["per_try_timeout"] = envoy.duration(rule.backend_timeout)
    action.update(rule.filters.rewrite)
    if rule.filters.headers.host is not None:
        action["host_rewrite_literal"] = rule.filters.headers.host
    return action


def _has_headers(headers: Headers) -> bool:
    return bool(
        headers.request_add
        or headers.request_remove
        or headers.response_add
        or headers.response_remove
    )


def _served_extras(backend: Backend, target: Obj) -> None:
    """For a pool behind an EPP: the ext_proc override, and the served endpoint back."""
    if backend.ext_proc is None:
        return
    target["typed_per_filter_config"] = {EXT_PROC_FILTER: backend.ext_proc}
    served = envoy.header_value_option(SERVED_HEADER, "%UPSTREAM_HOST%")
    target["response_headers_to_add"] = [*target.get("response_headers_to_add", []), served]


def _cluster_weight(backend: Backend, headers: Headers) -> Obj:
    weight: Obj = {"name": backend.cluster or INVALID_BACKEND_CLUSTER, "weight": backend.weight}
    if backend.cluster is not None:
        headers.apply(weight)
        _served_extras(backend, weight)
    return weight
