"""InferencePool backends: clusters, endpoints, the EPP (any conforming one), failure
modes, appProtocol, GIE's port rules, and the pool's status.parents per Gateway."""

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
    parent,
    path,
    pod,
    pool,
    pool_ref,
    rule,
    service,
    snapshot_resources,
    virtual_hosts,
    world,
)

from infergate.gateway.translate import TranslateOptions, translate
from infergate.gateway.types import CLUSTER_TYPE, ENDPOINT_TYPE, Translation

NOW = "2025-01-02T00:00:00Z"
GW = (INFRA, "gw")
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def run(
    *routes: dict[str, Any], options: TranslateOptions | None = None, **overrides: Any
) -> Translation:
    if routes:
        overrides["http_routes"] = routes
    return translate(world(**overrides), options or TranslateOptions(now=NOW))


def cluster(t: Translation, name: str) -> dict[str, Any]:
    return snapshot_resources(t.snapshots[GW], CLUSTER_TYPE)[name]


def endpoints(t: Translation, name: str) -> list[tuple[str, int]]:
    cla = snapshot_resources(t.snapshots[GW], ENDPOINT_TYPE)[name]
    return [
        (e["endpoint"]["address"]["socket_address"]["address"],
         e["endpoint"]["address"]["socket_address"]["port_value"])
        for group in cla["endpoints"]
        for e in group["lb_endpoints"]
    ]  # fmt: skip


def pool_entry(t: Translation, name: str, gateway: tuple[str, str] = GW) -> dict[str, Any]:
    (entry,) = [e for e in t.pool_parents[(APPS, name)] if e["parentRef"]["name"] == gateway[1]]
    return entry


def test_pool_cluster_follows_the_epps_pick() -> None:
    t = run()
    c = cluster(t, "pool/apps/primary")
    assert c["type"] == "EDS"
    assert c["eds_cluster_config"]["eds_config"]["ads"] == {}
    policy = c["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    assert policy["typed_config"]["override_host_sources"] == [
        {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}
    ]
    http = c["typed_extension_protocol_options"][HTTP_OPTIONS]["explicit_http_config"]
    assert "http_protocol_options" in http  # appProtocol unset: HTTP/1.1


def test_pool_endpoints_are_its_ready_pods_times_target_ports() -> None:
    pods = (
        pod("a", "10.0.1.1", {"app": "primary", "x": "y"}),
        pod("b", "10.0.1.2", {"app": "primary"}, ready=False),
        pod("c", "10.0.1.3", {"app": "other"}),
        pod("d", "10.0.1.4", {"app": "primary"}, namespace="elsewhere"),
        pod("primary-epp-0", "10.0.3.1", {"app": "primary-epp"}),
    )
    gone = pod("e", "10.0.1.5", {"app": "primary"})
    gone["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    t = run(
        pods=(*pods, gone),
        inference_pools=(pool("primary", ports=(3000, 3001), epp=("primary-epp", 9002)),),
        http_routes=(http_route("r", rules=[rule([pool_ref("primary")])]),),
    )
    assert endpoints(t, "pool/apps/primary") == [("10.0.1.1", 3000), ("10.0.1.1", 3001)]


@pytest.mark.parametrize("port", [None, 3000, 9999])
def test_backend_ref_port_is_ignored_for_pools(port: int | None) -> None:
    """GIE's InferencePoolHTTPRoutePortValidation: unspecified, matching and
    non-matching ports all route to the pool, Accepted and ResolvedRefs."""
    t = run(http_route("r", rules=[rule([pool_ref("primary", port=port)])]))
    (entry,) = t.route_parents[(APPS, "r")]
    assert conditions(entry) == {
        "Accepted": ("True", "Accepted"),
        "ResolvedRefs": ("True", "ResolvedRefs"),
    }
    (route,) = virtual_hosts(t.snapshots[GW])["*"]
    assert route["route"]["cluster"] == "pool/apps/primary"
    assert conditions(pool_entry(t, "primary"))["Accepted"] == ("True", "Accepted")


def test_missing_pool_is_backend_not_found() -> None:
    t = run(http_route("r", rules=[rule([pool_ref("ghost")])]))
    (entry,) = t.route_parents[(APPS, "r")]
    assert conditions(entry) == {
        "Accepted": ("True", "Accepted"),
        "ResolvedRefs": ("False", "BackendNotFound"),
    }
    (route,) = virtual_hosts(t.snapshots[GW])["*"]
    assert route["direct_response"] == {"status": 500}


@pytest.mark.parametrize(
    ("epp_ref", "services"),
    [
        ({"name": "ghost", "port": {"number": 9002}}, ()),
        ({"name": "primary-epp", "port": {"number": 1}}, None),
        ({"name": "primary-epp"}, None),
        ({"group": "x.io", "kind": "Picker", "name": "p"}, None),
        ({"name": "ext", "port": {"number": 9002}}, (service("ext", type="ExternalName"),)),
    ],
)
def test_invalid_epp_ref(epp_ref: dict[str, Any], services: tuple[Any, ...] | None) -> None:
    bad = pool("primary")
    bad["spec"]["endpointPickerRef"] = epp_ref
    overrides: dict[str, Any] = {"inference_pools": (bad,)}
    if services is not None:
        overrides["services"] = services
    t = run(http_route("r", rules=[rule([pool_ref("primary")])]), **overrides)
    assert conditions(pool_entry(t, "primary")) == {
        "Accepted": ("True", "Accepted"),
        "ResolvedRefs": ("False", "InvalidExtensionRef"),
    }
    (entry,) = t.route_parents[(APPS, "r")]
    assert conditions(entry)["Accepted"] == ("True", "Accepted")
    (route,) = virtual_hosts(t.snapshots[GW])["*"]
    assert route["direct_response"] == {"status": 500}  # never routed without its EPP


def test_pool_without_epp_ref() -> None:
    routes = (http_route("r", rules=[rule([pool_ref("solo")])]),)
    pools = (pool("solo", labels={"app": "primary"}),)
    balanced = run(*routes, inference_pools=pools)
    assert conditions(pool_entry(balanced, "solo")) == {
        "Accepted": ("True", "Accepted"),
        "ResolvedRefs": ("True", "ResolvedRefs"),
    }
    (route,) = virtual_hosts(balanced.snapshots[GW])["*"]
    assert route["route"]["cluster"] == "pool/apps/solo"
    assert "typed_per_filter_config" not in route
    refused = run(
        *routes, inference_pools=pools, options=TranslateOptions(now=NOW, pool_without_epp="reject")
    )
    assert conditions(pool_entry(refused, "solo"))["Accepted"] == (
        "False",
        "EndpointPickerRefMissing",
    )
    (route,) = virtual_hosts(refused.snapshots[GW])["*"]
    assert route["direct_response"] == {"status": 500}


@pytest.mark.parametrize(
    ("app_protocol", "http2"), [(None, False), ("http", False), ("kubernetes.io/h2c", True)]
)
def test_app_protocol(app_protocol: str | None, http2: bool) -> None:
    t = run(
        inference_pools=(pool("primary", epp=("primary-epp", 9002), app_protocol=app_protocol),)
    )
    http = cluster(t, "pool/apps/primary")["typed_extension_protocol_options"][HTTP_OPTIONS]
    assert ("http2_protocol_options" in http["explicit_http_config"]) is http2


def test_unknown_app_protocol_is_unsupported() -> None:
    t = run(inference_pools=(pool("primary", epp=("primary-epp", 9002), app_protocol="spdy"),))
    (entry,) = t.route_parents[(APPS, "primary")]
    assert conditions(entry)["ResolvedRefs"] == ("False", "UnsupportedProtocol")


def test_epp_cluster_transport_and_health() -> None:
    t = run()
    epp = cluster(t, "epp/apps/primary-epp/9002")
    assert epp["transport_socket"]["typed_config"]["sni"] == "primary-epp.apps.svc"
    assert epp["health_checks"][0]["tcp_health_check"] == {}
    assert epp["common_lb_config"] == {"healthy_panic_threshold": {"value": 0.0}}
    # A picker pod the Service stops selecting leaves at once, healthy or not.
    assert epp["ignore_health_on_host_removal"] is True
    http = epp["typed_extension_protocol_options"][HTTP_OPTIONS]["explicit_http_config"]
    assert "http2_protocol_options" in http
    plain = run(options=TranslateOptions(now=NOW, epp_tls=False, epp_health_check="grpc"))
    epp = cluster(plain, "epp/apps/primary-epp/9002")
    assert "transport_socket" not in epp
    assert epp["health_checks"][0]["grpc_health_check"] == {"service_name": "liveness"}
    h2c = service(
        "primary-epp",
        ports=[{"port": 9002, "targetPort": 9002, "appProtocol": "kubernetes.io/h2c"}],
    )
    t = run(services=(h2c,), options=TranslateOptions(now=NOW, epp_health_check="none"))
    epp = cluster(t, "epp/apps/primary-epp/9002")
    assert "transport_socket" not in epp and "health_checks" not in epp


def test_terminating_epp_stays_degraded_while_still_ready() -> None:
    """An EPP rollout seen late: the new EPP Ready and the old one deleted in one pass.
    The old one, terminating but still passing readiness (Kubernetes' ``serving``), stays
    in the EPP cluster as DEGRADED (used while the new one has not passed Envoy's health
    check); once its readiness fails it leaves. Pool and Service endpoints drop a
    terminating pod at once."""

    def deleted(p: dict[str, Any]) -> dict[str, Any]:
        p["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
        return p

    def statuses(t: Translation, name: str) -> dict[str, str | None]:
        cla = snapshot_resources(t.snapshots[GW], ENDPOINT_TYPE)[name]
        return {
            e["endpoint"]["address"]["socket_address"]["address"]: e.get("health_status")
            for group in cla["endpoints"]
            for e in group["lb_endpoints"]
        }

    new = pod("primary-epp-1", "10.0.3.9", {"app": "primary-epp"})
    old = deleted(pod("primary-epp-0", "10.0.3.1", {"app": "primary-epp"}))
    engine = deleted(pod("primary-9", "10.0.1.9", {"app": "primary"}))
    t = run(pods=(new, old, engine))
    assert statuses(t, "epp/apps/primary-epp/9002") == {"10.0.3.1": "DEGRADED", "10.0.3.9": None}
    assert endpoints(t, "pool/apps/primary") == []
    withdrawn = deleted(pod("primary-epp-0", "10.0.3.1", {"app": "primary-epp"}, ready=False))
    t = run(pods=(new, withdrawn))
    assert statuses(t, "epp/apps/primary-epp/9002") == {"10.0.3.9": None}


def test_multiple_rules_different_pools() -> None:
    """GIE's HTTPRouteMultipleRulesDifferentPools: each rule reaches its own pool through
    its own EPP."""
    t = run(
        http_route(
            "r",
            rules=[
                rule([pool_ref("primary")], [path("/primary")]),
                rule([pool_ref("secondary")], [path("/secondary")]),
            ],
        )
    )
    routes = {r["name"]: r for r in virtual_hosts(t.snapshots[GW])["*"]}
    for index, name in enumerate(("primary", "secondary")):
        route = routes[f"apps/r/rule/{index}/match/0"]
        assert route["route"]["cluster"] == f"pool/apps/{name}"
        override = route["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]
        assert override["grpc_service"]["envoy_grpc"]["cluster_name"] == f"epp/apps/{name}-epp/9002"


def test_pool_parents_per_gateway() -> None:
    """GIE's InferencePoolResolvedRefsCondition: one entry per Gateway routing to the
    pool; none once no route does."""
    second = gateway("gw2", listeners=[listener(hostname="secondary.example.com", from_="All")])
    routes = (
        http_route("to-1", rules=[rule([pool_ref("primary")])]),
        http_route("to-2", parents=[parent("gw2")], rules=[rule([pool_ref("primary")])]),
    )
    t = run(*routes, gateways=(gateway(), second))
    names = [e["parentRef"]["name"] for e in t.pool_parents[(APPS, "primary")]]
    assert names == ["gw", "gw2"]
    assert t.pool_parents[(APPS, "secondary")] == []
    only_second = run(routes[1], gateways=(gateway(), second))
    assert [e["parentRef"]["name"] for e in only_second.pool_parents[(APPS, "primary")]] == ["gw2"]
    none = run(gateways=(gateway(), second), http_routes=())
    assert none.pool_parents[(APPS, "primary")] == []


def test_pool_named_by_a_route_the_gateway_refuses() -> None:
    same = gateway(listeners=[listener(from_="Same")])
    t = run(http_route("r", rules=[rule([pool_ref("primary")])]), gateways=(same,))
    assert conditions(pool_entry(t, "primary"))["Accepted"] == ("False", "HTTPRouteNotAccepted")


def test_pool_status_keeps_transition_times() -> None:
    first = run()
    primary = pool("primary", epp=("primary-epp", 9002), generation=3)
    primary["status"] = {"parents": first.pool_parents[(APPS, "primary")]}
    second = run(
        inference_pools=(primary, pool("secondary", epp=("secondary-epp", 9002))),
        options=TranslateOptions(now="2025-05-05T00:00:00Z"),
    )
    (entry,) = second.pool_parents[(APPS, "primary")]
    assert {c["lastTransitionTime"] for c in entry["conditions"]} == {NOW}
    assert {c["observedGeneration"] for c in entry["conditions"]} == {3}
