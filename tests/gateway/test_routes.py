"""HTTPRoutes: attachment (and the spec's reasons when it fails), hostnames, matches,
precedence, filters, backendRefs and their statuses."""

from __future__ import annotations

from typing import Any

import pytest
from gateway_objects import (
    APPS,
    INFRA,
    conditions,
    gateway,
    http_route,
    listener,
    namespace,
    parent,
    path,
    pod,
    pool,
    pool_ref,
    reference_grant,
    route_names,
    rule,
    service,
    service_ref,
    virtual_hosts,
    world,
)

from infergate.gateway.backends import INVALID_BACKEND_CLUSTER
from infergate.gateway.translate import SHADOWED, TranslateOptions, translate
from infergate.gateway.types import Translation

NOW = "2025-01-02T00:00:00Z"
GW = (INFRA, "gw")


def run(
    *routes: dict[str, Any], options: TranslateOptions | None = None, **overrides: Any
) -> Translation:
    return translate(world(http_routes=routes, **overrides), options or TranslateOptions(now=NOW))


def parent_conditions(
    t: Translation, name: str, namespace: str = APPS
) -> dict[str, tuple[str, str]]:
    (entry,) = t.route_parents[(namespace, name)]
    return conditions(entry)


def parent_message(t: Translation, name: str, type_: str, namespace: str = APPS) -> str:
    (entry,) = t.route_parents[(namespace, name)]
    return next(str(x["message"]) for x in entry["conditions"] if x["type"] == type_)


def only_route(t: Translation, domain: str = "*") -> dict[str, Any]:
    (route,) = virtual_hosts(t.snapshots[GW])[domain]
    return route


# --- attachment ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ref", "reason"),
    [
        (parent(section="nope"), "NoMatchingParent"),
        (parent(port=8080), "NoMatchingParent"),
        (parent(section="http", port=81), "NoMatchingParent"),
        (parent(section="http", port=80), "Accepted"),
    ],
)
def test_parent_ref_section_and_port(ref: dict[str, Any], reason: str) -> None:
    t = run(http_route("r", parents=[ref]))
    assert parent_conditions(t, "r")["Accepted"][1] == reason


def test_allowed_routes_namespaces() -> None:
    same = gateway(listeners=[listener(from_="Same")])
    t = run(http_route("r"), gateways=(same,))
    assert parent_conditions(t, "r")["Accepted"] == ("False", "NotAllowedByListeners")
    selector = {"matchExpressions": [{"key": "team", "operator": "In", "values": ["ml"]}]}
    selected = gateway(listeners=[listener(from_="Selector", selector=selector)])
    labelled = (namespace(INFRA), namespace(APPS, {"team": "ml"}))
    t = run(http_route("r"), gateways=(selected,), namespaces=labelled)
    assert parent_conditions(t, "r")["Accepted"] == ("True", "Accepted")
    t = run(http_route("r"), gateways=(selected,))
    assert parent_conditions(t, "r")["Accepted"] == ("False", "NotAllowedByListeners")


def test_hostname_intersection() -> None:
    gw = gateway(listeners=[listener(hostname="*.example.com", from_="All")])
    t = run(
        http_route("none", hostnames=["other.org"]),
        http_route("narrow", hostnames=["a.example.com", "other.org"]),
        http_route("any"),
        gateways=(gw,),
    )
    assert parent_conditions(t, "none")["Accepted"] == ("False", "NoMatchingListenerHostname")
    assert parent_conditions(t, "narrow")["Accepted"] == ("True", "Accepted")
    hosts = virtual_hosts(t.snapshots[GW])
    assert set(hosts) == {"a.example.com", "*.example.com"}
    assert route_names(hosts["a.example.com"]) == [
        "apps/narrow/rule/0/match/0",
        "apps/any/rule/0/match/0",
    ]
    assert route_names(hosts["*.example.com"]) == ["apps/any/rule/0/match/0"]


def test_parents_not_ours_get_no_entry() -> None:
    t = run(
        http_route(
            "r", parents=[parent("elsewhere"), {"group": "x.io", "kind": "Mesh", "name": "m"}]
        )
    )
    assert t.route_parents[(APPS, "r")] == []


def test_parent_ref_is_echoed_and_one_entry_per_distinct_ref() -> None:
    refs = [parent(section="http"), parent(section="http"), parent()]
    t = run(http_route("r", parents=refs))
    assert [e["parentRef"] for e in t.route_parents[(APPS, "r")]] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": INFRA, "name": "gw", "sectionName": "http"},
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": INFRA, "name": "gw"},
    ]  # fmt: skip


def test_listener_isolation() -> None:
    """A request for foo.example.com is served by the foo listener's routes only."""
    gw = gateway(
        listeners=[
            listener("foo", hostname="foo.example.com", from_="All"),
            listener("wild", hostname="*.example.com", from_="All"),
            listener("any", from_="All"),
        ]
    )
    t = run(
        http_route("on-foo", parents=[parent(section="foo")]),
        http_route("on-wild", parents=[parent(section="wild")]),
        http_route(
            "on-any", parents=[parent(section="any")], hostnames=["foo.example.com", "x.org"]
        ),
        gateways=(gw,),
    )
    hosts = virtual_hosts(t.snapshots[GW])
    assert route_names(hosts["foo.example.com"]) == ["apps/on-foo/rule/0/match/0"]
    assert route_names(hosts["*.example.com"]) == ["apps/on-wild/rule/0/match/0"]
    assert route_names(hosts["x.org"]) == ["apps/on-any/rule/0/match/0"]
    assert hosts["*"] == []


# --- matches and precedence -------------------------------------------------------------


def test_match_translation() -> None:
    match = {
        "path": {"type": "PathPrefix", "value": "/v1/"},
        "headers": [
            {"name": "X-Model", "value": "a"},
            {"name": "x-model", "value": "ignored"},
            {"type": "RegularExpression", "name": "x-re", "value": "v[0-9]+"},
        ],
        "queryParams": [{"name": "q", "value": "1"}],
        "method": "POST",
    }
    route = only_route(run(http_route("r", rules=[rule([service_ref("echo")], [match])])))
    assert route["match"] == {
        "path_separated_prefix": "/v1",
        "headers": [
            {"name": "x-model", "string_match": {"exact": "a"}},
            {"name": "x-re", "string_match": {"safe_regex": {"regex": "v[0-9]+"}}},
            {"name": ":method", "string_match": {"exact": "POST"}},
        ],
        "query_parameters": [{"name": "q", "string_match": {"exact": "1"}}],
    }


@pytest.mark.parametrize(
    ("kind", "value", "envoy"),
    [
        ("PathPrefix", "/", {"prefix": "/"}),
        ("PathPrefix", "/abc", {"path_separated_prefix": "/abc"}),
        ("Exact", "/abc/", {"path": "/abc/"}),
        ("RegularExpression", "/v[12]/.*", {"safe_regex": {"regex": "/v[12]/.*"}}),
    ],
)
def test_path_matches(kind: str, value: str, envoy: dict[str, Any]) -> None:
    t = run(http_route("r", rules=[rule([service_ref("echo")], [path(value, kind)])]))
    assert only_route(t)["match"] == envoy


def test_precedence_across_routes() -> None:
    t = run(
        http_route(
            "young",
            created="2025-03-01T00:00:00Z",
            rules=[rule([service_ref("echo")], [path("/a")])],
        ),
        http_route(
            "b-old",
            created="2025-01-01T00:00:00Z",
            rules=[rule([service_ref("echo")], [path("/a")])],
        ),
        http_route(
            "a-old",
            created="2025-01-01T00:00:00Z",
            rules=[rule([service_ref("echo")], [path("/a")])],
        ),
        http_route(
            "mix",
            created="2025-06-01T00:00:00Z",
            rules=[
                rule([service_ref("echo")], [path("/")]),
                rule([service_ref("echo")], [path("/a/b")]),
                rule(
                    [service_ref("echo")],
                    [{**path("/a"), "headers": [{"name": "h", "value": "1"}]}],
                ),
                rule([service_ref("echo")], [{**path("/a"), "method": "GET"}]),
                rule(
                    [service_ref("echo")],
                    [{**path("/a"), "queryParams": [{"name": "q", "value": "1"}]}],
                ),
                rule([service_ref("echo")], [path("/a", "Exact")]),
                rule([service_ref("echo")], [path("/a.*", "RegularExpression")]),
            ],
        ),
    )
    assert route_names(virtual_hosts(t.snapshots[GW])["*"]) == [
        "apps/mix/rule/5/match/0",  # Exact
        "apps/mix/rule/6/match/0",  # RegularExpression
        "apps/mix/rule/1/match/0",  # longest prefix
        "apps/mix/rule/3/match/0",  # method
        "apps/mix/rule/2/match/0",  # headers
        "apps/mix/rule/4/match/0",  # query params
        "apps/a-old/rule/0/match/0",  # oldest, then namespace/name
        "apps/b-old/rule/0/match/0",
        "apps/young/rule/0/match/0",
        "apps/mix/rule/0/match/0",  # "/"
    ]
    # Routes that overlap are all accepted: precedence, not rejection, settles it.
    for name in ("young", "b-old", "a-old", "mix"):
        assert parent_conditions(t, name)["Accepted"] == ("True", "Accepted")
    # The routes that lost a match to an identical, older one are told which route serves it.
    for loser in ("young", "b-old"):
        assert parent_conditions(t, loser)[SHADOWED] == ("True", "ShadowedByPrecedence")
        assert "apps/a-old" in parent_message(t, loser, SHADOWED)
    assert SHADOWED not in parent_conditions(t, "a-old")
    assert SHADOWED not in parent_conditions(t, "mix")


def test_exact_hostname_routes_win_over_wildcard_ones() -> None:
    t = run(
        http_route(
            "wild",
            hostnames=["*.example.com"],
            rules=[rule([service_ref("echo")], [path("/a/b/c")])],
        ),
        http_route(
            "exact", hostnames=["foo.example.com"], rules=[rule([service_ref("echo")], [path("/")])]
        ),
    )
    assert route_names(virtual_hosts(t.snapshots[GW])["foo.example.com"]) == [
        "apps/exact/rule/0/match/0",
        "apps/wild/rule/0/match/0",
    ]


# --- backends -----------------------------------------------------------------------------


def test_missing_service_answers_500_and_says_why() -> None:
    t = run(http_route("r", rules=[rule([service_ref("ghost")])]))
    assert parent_conditions(t, "r") == {
        "Accepted": ("True", "Accepted"),
        "ResolvedRefs": ("False", "BackendNotFound"),
    }
    assert only_route(t)["direct_response"] == {"status": 500}


def test_unknown_backend_kind() -> None:
    t = run(http_route("r", rules=[rule([{"group": "x.io", "kind": "Bucket", "name": "b"}])]))
    assert parent_conditions(t, "r")["ResolvedRefs"] == ("False", "InvalidKind")
    assert only_route(t)["direct_response"] == {"status": 500}


def test_service_port_is_required_and_must_exist() -> None:
    t = run(
        http_route("noport", rules=[rule([service_ref("echo", port=None)])]),
        http_route("badport", rules=[rule([service_ref("echo", port=1234)])]),
    )
    assert parent_conditions(t, "noport")["ResolvedRefs"] == ("False", "BackendNotFound")
    assert parent_conditions(t, "badport")["ResolvedRefs"] == ("False", "BackendNotFound")


def test_cross_namespace_backends_need_a_reference_grant() -> None:
    other = service("echo", namespace="other")
    refs = [rule([service_ref("echo", namespace="other")])]
    t = run(http_route("r", rules=refs), services=(other,))
    assert parent_conditions(t, "r")["ResolvedRefs"] == ("False", "RefNotPermitted")
    granted = run(
        http_route("r", rules=refs),
        services=(other,),
        reference_grants=(reference_grant("other", APPS, "Service"),),
    )
    assert parent_conditions(granted, "r")["ResolvedRefs"] == ("True", "ResolvedRefs")
    assert only_route(granted)["route"]["cluster"] == "service/other/echo/8080"
    named = run(
        http_route("r", rules=refs),
        services=(other,),
        reference_grants=(reference_grant("other", APPS, "Service", to_name="not-echo"),),
    )
    assert parent_conditions(named, "r")["ResolvedRefs"] == ("False", "RefNotPermitted")
    wrong_ns = run(
        http_route("r", rules=refs),
        services=(other,),
        reference_grants=(reference_grant(APPS, APPS, "Service"),),
    )
    assert parent_conditions(wrong_ns, "r")["ResolvedRefs"] == ("False", "RefNotPermitted")


def test_weights_and_invalid_shares() -> None:
    t = run(
        http_route(
            "r",
            rules=[
                rule(
                    [service_ref("echo", weight=3), service_ref("ghost", weight=1)],
                    [path("/mixed")],
                ),
                rule([service_ref("echo", weight=0)], [path("/zero")]),
                rule(
                    [service_ref("echo", weight=0), service_ref("ghost", weight=2)], [path("/bad")]
                ),
            ],
        )
    )
    routes = {r["name"]: r for r in virtual_hosts(t.snapshots[GW])["*"]}
    mixed = routes["apps/r/rule/0/match/0"]["route"]
    assert mixed["weighted_clusters"]["clusters"] == [
        {"name": "service/apps/echo/8080", "weight": 3},
        {"name": INVALID_BACKEND_CLUSTER, "weight": 1},
    ]
    assert mixed["cluster_not_found_response_code"] == "INTERNAL_SERVER_ERROR"
    assert routes["apps/r/rule/1/match/0"]["direct_response"] == {"status": 500}
    assert routes["apps/r/rule/2/match/0"]["direct_response"] == {"status": 500}


def test_rule_without_backends_answers_500() -> None:
    t = run(http_route("r", rules=[rule()]))
    assert only_route(t)["direct_response"] == {"status": 500}


def test_service_app_protocols() -> None:
    services = (
        service("h2", ports=[{"port": 8080, "targetPort": 80, "appProtocol": "kubernetes.io/h2c"}]),
        service("tls", ports=[{"port": 8080, "targetPort": 80, "appProtocol": "https"}]),
    )
    t = run(
        http_route("h2", rules=[rule([service_ref("h2")])]),
        http_route("tls", rules=[rule([service_ref("tls")])]),
        services=services,
    )
    assert parent_conditions(t, "tls")["ResolvedRefs"] == ("False", "UnsupportedProtocol")
    clusters = {
        c["name"]: c
        for c in t.snapshots[GW].resources["type.googleapis.com/envoy.config.cluster.v3.Cluster"]
    }
    options = clusters["service/apps/h2/8080"]["typed_extension_protocol_options"]
    http = options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
    assert "http2_protocol_options" in http


# --- filters --------------------------------------------------------------------------------


def _filtered(
    *filters: dict[str, Any], backends: list[dict[str, Any]] | None = None, **kw: Any
) -> dict[str, Any]:
    backends = [service_ref("echo")] if backends is None else backends
    t = run(http_route("r", rules=[rule(backends, [path("/p")], filters=list(filters))]), **kw)
    return only_route(t)


def test_header_modifiers() -> None:
    route = _filtered(
        {
            "type": "RequestHeaderModifier",
            "requestHeaderModifier": {
                "set": [{"name": "x-s", "value": "50%"}, {"name": "Host", "value": "h.example"}],
                "add": [{"name": "x-a", "value": "1"}],
                "remove": ["x-r"],
            },
        },
        {"type": "ResponseHeaderModifier", "responseHeaderModifier": {"remove": ["server"]}},
    )
    assert route["request_headers_to_add"] == [
        {"header": {"key": "x-s", "value": "50%%"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
        {"header": {"key": "x-a", "value": "1"}, "append_action": "APPEND_IF_EXISTS_OR_ADD"},
    ]
    assert route["request_headers_to_remove"] == ["x-r"]
    assert route["response_headers_to_remove"] == ["server"]
    assert route["route"]["host_rewrite_literal"] == "h.example"


@pytest.mark.parametrize(
    "bad_filter",
    [
        {"type": "CORS", "cors": {"allowOrigins": ["*"]}},
        {"type": "RequestMirror", "requestMirror": {"backendRef": {"name": "echo", "port": 8080}}},
        {"type": "ExtensionRef", "extensionRef": {"group": "x.io", "kind": "F", "name": "f"}},
        {"type": "Teleport"},
        {
            "type": "RequestHeaderModifier",
            "requestHeaderModifier": {
                "set": [{"name": "x-gateway-destination-endpoint", "value": "1.2.3.4:80"}]
            },
        },
    ],
)
def test_unsupported_filters_make_their_rule_answer_500(bad_filter: dict[str, Any]) -> None:
    good = rule([service_ref("echo")], [path("/good")])
    bad = rule([service_ref("echo")], [path("/bad")], filters=[bad_filter])
    t = run(http_route("r", rules=[good, bad]))
    got = parent_conditions(t, "r")
    assert got["Accepted"] == ("True", "Accepted")
    assert got["PartiallyInvalid"] == ("True", "UnsupportedValue")
    (entry,) = t.route_parents[(APPS, "r")]
    message = next(c["message"] for c in entry["conditions"] if c["type"] == "PartiallyInvalid")
    assert message.startswith("Dropped Rule")
    routes = {r["name"]: r for r in virtual_hosts(t.snapshots[GW])["*"]}
    assert routes["apps/r/rule/1/match/0"]["direct_response"] == {"status": 500}
    assert routes["apps/r/rule/0/match/0"]["route"]["cluster"] == "service/apps/echo/8080"


def test_route_with_only_invalid_rules_is_not_accepted() -> None:
    t = run(http_route("r", rules=[rule([service_ref("echo")], [path("/(", "RegularExpression")])]))
    assert parent_conditions(t, "r")["Accepted"] == ("False", "UnsupportedValue")
    assert virtual_hosts(t.snapshots[GW])["*"] == []


@pytest.mark.parametrize(
    "pattern",
    ["(?=x)a", "(a)\\1", "a{1001}", "(?x) a", "a++", "\\Z", "[", "\\p{L}", "((a{999}){999}){9}"],
)
def test_regexes_re2_would_refuse_are_caught(pattern: str) -> None:
    t = run(
        http_route(
            "r",
            rules=[
                rule([service_ref("echo")], [path("/ok")]),
                rule([service_ref("echo")], [path(pattern, "RegularExpression")]),
            ],
        )
    )
    assert parent_conditions(t, "r")["PartiallyInvalid"][0] == "True"
    assert route_names(virtual_hosts(t.snapshots[GW])["*"]) == ["apps/r/rule/0/match/0"]


def test_redirects() -> None:
    route = _filtered(
        {"type": "RequestRedirect", "requestRedirect": {"scheme": "https"}}, backends=[]
    )
    assert route["redirect"] == {"scheme_redirect": "https", "response_code": "FOUND"}
    gw8080 = gateway(listeners=[listener(port=8080, from_="All")])
    t = run(
        http_route(
            "r",
            rules=[
                rule(
                    matches=[path("/p")],
                    filters=[
                        {
                            "type": "RequestRedirect",
                            "requestRedirect": {
                                "hostname": "x.org",
                                "statusCode": 308,
                                "path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": "/q"},
                            },
                        }
                    ],
                )
            ],
        ),
        gateways=(gw8080,),
    )
    (route,) = virtual_hosts(t.snapshots[GW], 8080)["*"]
    assert route["redirect"] == {
        "host_redirect": "x.org",
        "response_code": "PERMANENT_REDIRECT",
        "prefix_rewrite": "/q",
        "port_redirect": 8080,
    }


@pytest.mark.parametrize(
    ("replacement", "expected"),
    [
        ("/xyz", {"prefix_rewrite": "/xyz"}),
        ("/xyz/", {"prefix_rewrite": "/xyz"}),
        ("/", {"regex_rewrite": {"pattern": {"regex": "^/p/*"}, "substitution": "/"}}),
    ],
)
def test_prefix_rewrites(replacement: str, expected: dict[str, Any]) -> None:
    route = _filtered(
        {
            "type": "URLRewrite",
            "urlRewrite": {
                "path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": replacement}
            },
        }
    )
    assert {k: route["route"][k] for k in expected} == expected


def test_timeouts() -> None:
    t = run(
        http_route(
            "r",
            rules=[
                rule(
                    [service_ref("echo")],
                    [path("/a")],
                    timeouts={"request": "1m30s", "backendRequest": "500ms"},
                ),
                rule([service_ref("echo")], [path("/b")], timeouts={"request": "0s"}),
                rule([service_ref("echo")], [path("/c")], timeouts={"request": "soon"}),
            ],
        )
    )
    routes = {r["name"]: r for r in virtual_hosts(t.snapshots[GW])["*"]}
    a = routes["apps/r/rule/0/match/0"]["route"]
    assert a["timeout"] == "90s" and a["retry_policy"] == {
        "num_retries": 0,
        "per_try_timeout": "0.5s",
    }
    assert routes["apps/r/rule/1/match/0"]["route"]["timeout"] == "0s"
    assert routes["apps/r/rule/2/match/0"]["direct_response"] == {"status": 500}


def test_backend_filters_go_on_their_weighted_cluster() -> None:
    modifier = {
        "type": "RequestHeaderModifier",
        "requestHeaderModifier": {"set": [{"name": "x-backend", "value": "echo"}]},
    }
    t = run(http_route("r", rules=[rule([service_ref("echo", filters=[modifier])])]))
    (weight,) = only_route(t)["route"]["weighted_clusters"]["clusters"]
    assert weight["name"] == "service/apps/echo/8080"
    assert weight["request_headers_to_add"][0]["header"] == {"key": "x-backend", "value": "echo"}


def test_pods_behind_a_service() -> None:
    pods = (
        pod("a", "10.1.0.1", {"app": "echo"}, ports={"web": 3000}),
        pod("b", "10.1.0.2", {"app": "echo"}, ports={"web": 3001}),
        pod("not-ready", "10.1.0.3", {"app": "echo"}, ready=False, ports={"web": 3000}),
        pod("no-port", "10.1.0.4", {"app": "echo"}),
        pod("other-ns", "10.1.0.5", {"app": "echo"}, namespace="other", ports={"web": 3000}),
        pod("bad-ip", "not-an-ip", {"app": "echo"}, ports={"web": 3000}),
    )
    t = run(http_route("r", rules=[rule([service_ref("echo")])]), pods=pods)
    cla = next(
        c
        for c in t.snapshots[GW].resources[
            "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
        ]
        if c["cluster_name"] == "service/apps/echo/8080"
    )
    addresses = [
        e["endpoint"]["address"]["socket_address"] for e in cla["endpoints"][0]["lb_endpoints"]
    ]
    assert addresses == [
        {"address": "10.1.0.1", "port_value": 3000},
        {"address": "10.1.0.2", "port_value": 3001},
    ]


def test_pool_route_with_pool_and_service_split() -> None:
    t = run(http_route("r", rules=[rule([pool_ref("primary"), service_ref("echo")])]))
    weights = only_route(t)["route"]["weighted_clusters"]["clusters"]
    pool_weight, service_weight = weights
    assert pool_weight["name"] == "pool/apps/primary"
    assert "envoy.filters.http.ext_proc" in pool_weight["typed_per_filter_config"]
    assert pool_weight["response_headers_to_add"][0]["header"]["key"] == (
        "x-gateway-destination-endpoint-served"
    )
    assert service_weight == {"name": "service/apps/echo/8080", "weight": 1}


def test_routes_in_other_namespaces_than_pools_with_grant() -> None:
    t = run(
        http_route("r", namespace="team", rules=[rule([pool_ref("primary", namespace=APPS)])]),
        reference_grants=(
            reference_grant(APPS, "team", "InferencePool", "inference.networking.k8s.io"),
        ),
        inference_pools=(pool("primary", epp=("primary-epp", 9002)),),
    )
    assert parent_conditions(t, "r", "team")["ResolvedRefs"] == ("True", "ResolvedRefs")
    assert only_route(t)["route"]["cluster"] == "pool/apps/primary"
    (entry,) = t.pool_parents[(APPS, "primary")]
    assert conditions(entry)["Accepted"] == ("True", "Accepted")
