"""Fuzzing the translator: garbage never raises, and random worlds keep the invariants
that make the config safe to hand to Envoy.

* every cluster a route (or an ext_proc override) names is in the snapshot, with its
  endpoints; the never-defined invalid-backend name is never defined;
* a pool cluster holds only ready pods of that pool, at its target ports;
* a route reaches a pool only if its rule names that pool, and always through that
  pool's own EPP; a plain Service is never routed through an EPP;
* every resource parses into its Envoy proto; every status condition is well formed;
* the last-resort guard in ``translate`` never fires.
"""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path
from typing import Any

from gateway_objects import (
    gateway,
    gateway_class,
    http_route,
    listener,
    namespace,
    parent,
    pod,
    pool,
    pool_ref,
    reference_grant,
    rule,
    service,
    service_ref,
    world,
)
from google.protobuf.json_format import ParseDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_translate_envoy import MESSAGES

from infergate.envoy import find_envoy
from infergate.envoy.process import validate_config
from infergate.gateway.backends import INVALID_BACKEND_CLUSTER
from infergate.gateway.static import static_bootstrap
from infergate.gateway.translate import TranslateOptions, translate
from infergate.gateway.types import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    ROUTE_TYPE,
    ClusterObjects,
    Snapshot,
    Translation,
)

NOW = "2025-01-02T00:00:00Z"
FIELDS = [
    "metadata", "name", "namespace", "generation", "creationTimestamp", "labels", "spec",
    "status", "listeners", "port", "protocol", "hostname", "allowedRoutes", "namespaces",
    "from", "selector", "kinds", "group", "kind", "parentRefs", "sectionName", "hostnames",
    "rules", "matches", "path", "type", "value", "headers", "queryParams", "method",
    "filters", "backendRefs", "weight", "requestHeaderModifier", "set", "add", "remove",
    "requestRedirect", "urlRewrite", "timeouts", "request", "matchLabels", "targetPorts",
    "number", "endpointPickerRef", "failureMode", "appProtocol", "ports", "targetPort",
    "podIP", "conditions", "containers", "containerPort", "controllerName",
    "gatewayClassName", "to", "addresses", "parents",
]  # fmt: skip
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 70000)
    | st.sampled_from(["", "/", "HTTP", "All", "Exact", "*", "a", "x-gateway-destination-endpoint"])
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=25,
)


def _check(objects: ClusterObjects, options: TranslateOptions | None = None) -> Translation:
    t = translate(objects, options or TranslateOptions(now=NOW))
    json.dumps([list(t.gateway_status.values()), t.gateway_class_status])
    for entries in [*t.route_parents.values(), *t.pool_parents.values()]:
        for entry in entries:
            _check_conditions(entry["conditions"])
    for status in t.gateway_status.values():
        _check_conditions(status["conditions"])
        for x in status["listeners"]:
            _check_conditions(x["conditions"])
    for snapshot in t.snapshots.values():
        _check_snapshot(snapshot, objects)
    return t


def _check_conditions(conditions: list[dict[str, Any]]) -> None:
    assert len({c["type"] for c in conditions}) == len(conditions)
    for c in conditions:
        assert c["status"] in ("True", "False", "Unknown")
        assert c["reason"] and isinstance(c["reason"], str)
        assert isinstance(c["observedGeneration"], int)
        assert "internal error" not in c["message"]


def _check_snapshot(snapshot: Snapshot, objects: ClusterObjects) -> None:
    resources = snapshot.resources
    for type_url, items in resources.items():
        names = [r.get("name") or r.get("cluster_name") for r in items]
        assert len(names) == len(set(names)), type_url
        for item in items:
            ParseDict(copy.deepcopy(item), MESSAGES[type_url]())
    clusters = {c["name"] for c in resources[CLUSTER_TYPE]}
    assert INVALID_BACKEND_CLUSTER not in clusters
    assert clusters == {c["cluster_name"] for c in resources[ENDPOINT_TYPE]}
    for table in resources[ROUTE_TYPE]:
        domains = [d for v in table["virtual_hosts"] for d in v["domains"]]
        assert len(domains) == len(set(domains))
        for vhost in table["virtual_hosts"]:
            for route in vhost["routes"]:
                _check_route(route, clusters, objects)
    for cla in resources[ENDPOINT_TYPE]:
        if cla["cluster_name"].startswith("pool/"):
            _check_pool_endpoints(cla, objects)


def _targets(route: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(cluster, per-filter config in force) for every upstream a route can pick."""
    action = route.get("route")
    if action is None:
        return []
    if "cluster" in action:
        return [(action["cluster"], route.get("typed_per_filter_config", {}))]
    return [
        (w["name"], w.get("typed_per_filter_config", {}))
        for w in action["weighted_clusters"]["clusters"]
    ]


def _rule_of(route: dict[str, Any], objects: ClusterObjects) -> dict[str, Any]:
    ns, name, _, index, _, _ = route["name"].split("/")
    obj = next(
        r for r in objects.http_routes
        if r["metadata"]["namespace"] == ns and r["metadata"]["name"] == name
    )  # fmt: skip
    return (obj["spec"].get("rules") or [{}])[int(index)]


def _check_route(route: dict[str, Any], clusters: set[str], objects: ClusterObjects) -> None:
    rule_spec = _rule_of(route, objects)
    ns = route["name"].split("/")[0]
    named_pools = {
        f"pool/{ref.get('namespace') or ns}/{ref.get('name')}"
        for ref in rule_spec.get("backendRefs") or []
        if isinstance(ref, dict) and ref.get("kind") == "InferencePool"
    }
    for cluster, per_filter in _targets(route):
        assert cluster == INVALID_BACKEND_CLUSTER or cluster in clusters
        ext_proc = per_filter.get("envoy.filters.http.ext_proc")
        if cluster.startswith("pool/"):
            assert cluster in named_pools  # never a pool the rule did not name
            if ext_proc is not None:
                epp = ext_proc["overrides"]["grpc_service"]["envoy_grpc"]["cluster_name"]
                assert epp in clusters and epp == _epp_cluster_of(cluster, objects)
        else:
            assert ext_proc is None


def _epp_cluster_of(pool_cluster: str, objects: ClusterObjects) -> str:
    _, ns, name = pool_cluster.split("/")
    obj = next(
        p for p in objects.inference_pools
        if p["metadata"]["namespace"] == ns and p["metadata"]["name"] == name
    )  # fmt: skip
    ref = obj["spec"]["endpointPickerRef"]
    return f"epp/{ns}/{ref['name']}/{ref['port']['number']}"


def _check_pool_endpoints(cla: dict[str, Any], objects: ClusterObjects) -> None:
    _, ns, name = cla["cluster_name"].split("/")
    obj = next(
        p for p in objects.inference_pools
        if p["metadata"]["namespace"] == ns and p["metadata"]["name"] == name
    )  # fmt: skip
    wanted = obj["spec"]["selector"]["matchLabels"]
    ports = {p["number"] for p in obj["spec"]["targetPorts"]}
    members = {
        p["status"]["podIP"]
        for p in objects.pods
        if p["metadata"]["namespace"] == ns
        and all(p["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())
        and p["status"]["conditions"][0]["status"] == "True"
    }
    for group in cla["endpoints"]:
        for e in group["lb_endpoints"]:
            address = e["endpoint"]["address"]["socket_address"]
            assert address["address"] in members and address["port_value"] in ports


# --- garbage ----------------------------------------------------------------------------


@SETTINGS
@given(
    st.lists(json_values, max_size=3),
    st.lists(json_values, max_size=3),
    st.lists(json_values, max_size=4),
    st.lists(json_values, max_size=3),
    st.lists(json_values, max_size=3),
)
def test_garbage_never_raises(
    classes: list[Any], gateways: list[Any], routes: list[Any], pools: list[Any], pods: list[Any]
) -> None:
    translate(
        ClusterObjects(
            gateway_classes=(gateway_class(), *classes),
            gateways=(gateway(), *gateways),
            http_routes=tuple(routes),
            inference_pools=tuple(pools),
            services=tuple(pools),
            pods=tuple(pods),
            namespaces=tuple(gateways),
            reference_grants=tuple(routes),
        ),
        TranslateOptions(now=NOW),
    )


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.extend(_paths(v, (*prefix, i)))
    return out


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    value = copy.deepcopy(value)
    target = value
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = new
    return value


@SETTINGS
@given(st.data())
def test_one_corrupted_field_never_raises(data: st.DataObject) -> None:
    """The realistic world with one subtree of one object replaced by garbage."""
    base = world()
    field = data.draw(
        st.sampled_from(["gateways", "http_routes", "inference_pools", "services", "pods"])
    )
    items = list(getattr(base, field))
    index = data.draw(st.integers(0, len(items) - 1))
    where = data.draw(st.sampled_from(_paths(items[index])))
    items[index] = _replace(items[index], where, data.draw(json_values))
    objects = ClusterObjects(**{**base.__dict__, field: tuple(items)})
    t = translate(objects, TranslateOptions(now=NOW))
    json.dumps([list(d.values()) for d in (t.gateway_status, t.route_parents, t.pool_parents)])


# --- random worlds ---------------------------------------------------------------------

NAMES = ["a", "b", "c"]
NSES = ["apps", "other"]
PATHS = [("PathPrefix", "/"), ("PathPrefix", "/v1"), ("Exact", "/v1/x"), ("RegularExpression", "/v[0-9]+"),
         ("RegularExpression", "(?=bad)"), ("PathPrefix", "no-slash"), ("Bogus", "/")]  # fmt: skip
FILTERS: list[dict[str, Any]] = [
    {"type": "RequestHeaderModifier", "requestHeaderModifier": {"set": [{"name": "x", "value": "1"}]}},
    {"type": "ResponseHeaderModifier", "responseHeaderModifier": {"remove": ["y"]}},
    {"type": "CORS", "cors": {}},
    {"type": "URLRewrite", "urlRewrite": {"hostname": "h.example"}},
    {"type": "RequestHeaderModifier", "requestHeaderModifier": {"set": [{"name": "x-gateway-destination-endpoint", "value": "1"}]}},
]  # fmt: skip


@st.composite
def backend_refs(draw: st.DrawFn) -> dict[str, Any]:
    name = draw(st.sampled_from(NAMES * 3 + ["ghost"]))
    ns = draw(st.sampled_from([None] * 4 + NSES))
    weight = draw(st.sampled_from([1, 1, 2, 0]))
    kind = draw(st.sampled_from(["pool"] * 4 + ["service", "service", "bogus"]))
    if kind == "pool":
        return pool_ref(
            name, namespace=ns, port=draw(st.sampled_from([None, 3000, 1])), weight=weight
        )
    if kind == "service":
        return service_ref(
            name, port=draw(st.sampled_from([None, 8080, 1])), namespace=ns, weight=weight
        )
    return {"group": "x.io", "kind": "Thing", "name": name, "weight": weight}


@st.composite
def rules(draw: st.DrawFn) -> dict[str, Any]:
    matches = [
        {"path": {"type": kind, "value": value}}
        for kind, value in draw(
            st.lists(st.sampled_from(PATHS[:4] * 3 + PATHS[4:]), min_size=1, max_size=2)
        )
    ]
    filters = draw(
        st.lists(
            st.sampled_from(FILTERS[:2] * 3 + FILTERS[2:]),
            max_size=2,
            unique_by=lambda f: str(f["type"]),
        )
    )
    return rule(draw(st.lists(backend_refs(), min_size=1, max_size=3)), matches, filters=filters)


@st.composite
def worlds(draw: st.DrawFn) -> ClusterObjects:
    listeners = [
        listener(
            f"l{i}",
            port=draw(st.sampled_from([80, 81])),
            protocol=draw(st.sampled_from(["HTTP"] * 6 + ["HTTPS"])),
            hostname=draw(st.sampled_from([None, None, "a.example.com", "*.example.com"])),
            from_=draw(st.sampled_from(["All"] * 8 + ["Same", "Bogus"])),
        )
        for i in range(draw(st.integers(1, 3)))
    ]
    routes = [
        http_route(
            f"r{i}",
            namespace=draw(st.sampled_from(NSES)),
            parents=[parent(section=draw(st.sampled_from([None, None, "l0", "l1"])))],
            hostnames=draw(st.lists(st.sampled_from(["a.example.com", "b.example.com", "*.example.com"]), max_size=2, unique=True)),
            rules=draw(st.lists(rules(), min_size=1, max_size=3)),
            created=draw(st.sampled_from(["2025-01-01T00:00:00Z", "2025-02-01T00:00:00Z"])),
        )
        for i in range(draw(st.integers(1, 4)))
    ]  # fmt: skip
    pools = []
    for name in NAMES:
        for ns in NSES:
            if draw(st.sampled_from([True, True, True, False])):
                epp = draw(
                    st.sampled_from([("epp", 9002)] * 3 + [None, ("epp", 1), ("ghost", 9002)])
                )
                pools.append(
                    pool(
                        name,
                        namespace=ns,
                        labels={"app": draw(st.sampled_from(NAMES))},
                        ports=tuple(draw(st.lists(st.sampled_from([3000, 3001]), min_size=1, max_size=2, unique=True))),
                        epp=epp,
                        failure_mode=draw(st.sampled_from(["FailOpen", "FailClose"])),
                        app_protocol=draw(st.sampled_from([None, None, "http", "kubernetes.io/h2c", "spdy"])),
                    )
                )  # fmt: skip
    services = [
        service(n, namespace=ns, selector={"app": n}, ports=[{"port": 8080, "targetPort": "web"}])
        for n in NAMES
        for ns in NSES
    ] + [service("epp", namespace=ns, ports=[{"port": 9002, "targetPort": 9002}]) for ns in NSES]
    pods = [
        pod(
            f"p{i}",
            f"10.0.0.{i + 1}",
            {"app": draw(st.sampled_from([*NAMES, "epp"]))},
            namespace=draw(st.sampled_from(NSES)),
            ready=draw(st.sampled_from([True, True, False])),
            ports={"web": 3000},
        )
        for i in range(draw(st.integers(0, 8)))
    ]
    grants = (
        [reference_grant("other", "apps", "InferencePool", "inference.networking.k8s.io")]
        if draw(st.booleans())
        else []
    )
    return ClusterObjects(
        gateway_classes=(gateway_class(),),
        gateways=(gateway(listeners=listeners),),
        http_routes=tuple(routes),
        inference_pools=tuple(pools),
        services=tuple(services),
        pods=tuple(pods),
        namespaces=(namespace("infra"), *(namespace(ns) for ns in NSES)),
        reference_grants=tuple(grants),
        gateway_programmed={("infra", "gw"): draw(st.booleans())},
    )


@SETTINGS
@given(worlds(), st.booleans())
def test_random_worlds_keep_the_invariants(objects: ClusterObjects, reject: bool) -> None:
    _check(objects, TranslateOptions(now=NOW, pool_without_epp="reject" if reject else "balance"))


def test_the_realistic_world_keeps_the_invariants() -> None:
    _check(world())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds())
def test_real_envoy_accepts_random_worlds(objects: ClusterObjects) -> None:
    """Envoy itself, on a sample of random worlds (static rendering: routes included)."""
    t = translate(objects, TranslateOptions(now=NOW))
    with tempfile.TemporaryDirectory() as tmp:
        for key, snapshot in t.snapshots.items():
            # JSON, not YAML: Envoy's YAML reads a bare `y` (a header name here) as a bool.
            config = Path(tmp) / "envoy.json"
            config.write_text(json.dumps(static_bootstrap(snapshot, "/".join(key))))
            validate_config(config, envoy=find_envoy())
