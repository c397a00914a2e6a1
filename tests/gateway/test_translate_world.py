"""The translator on a realistic world (GIE's conformance shape): what Envoy gets and
what every object's status says."""

from __future__ import annotations

from typing import Any

import pytest
from gateway_objects import APPS, INFRA, world

from infergate.gateway.translate import TranslateOptions, translate
from infergate.gateway.types import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    GATEWAY_CONTROLLER_NAME,
    LISTENER_TYPE,
    ROUTE_TYPE,
    Translation,
)

NOW = "2025-01-02T00:00:00Z"
GW = (INFRA, "gw")


def run(**overrides: Any) -> Translation:
    return translate(world(**overrides), TranslateOptions(now=NOW))


def conditions(entry: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in entry["conditions"]}


def resources(t: Translation, type_url: str) -> dict[str, dict[str, Any]]:
    return {r.get("name") or r["cluster_name"]: r for r in t.snapshots[GW].resources[type_url]}


def vhost(t: Translation, domain: str, port: int = 80) -> list[dict[str, Any]]:
    config = resources(t, ROUTE_TYPE)[f"http-{port}"]
    return next(v["routes"] for v in config["virtual_hosts"] if domain in v["domains"])


def test_statuses_of_a_healthy_world() -> None:
    t = run()
    assert conditions(t.gateway_class_status["infergate"]) == {"Accepted": ("True", "Accepted")}
    status = t.gateway_status[GW]
    assert conditions(status) == {
        "Accepted": ("True", "Accepted"),
        "Programmed": ("True", "Programmed"),
    }
    assert status["addresses"] == [{"type": "IPAddress", "value": "10.96.0.10"}]
    (listener,) = status["listeners"]
    assert listener["attachedRoutes"] == 3
    assert listener["supportedKinds"] == [
        {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute"}
    ]
    assert conditions(listener) == {
        "Accepted": ("True", "Accepted"),
        "Conflicted": ("False", "NoConflicts"),
        "ResolvedRefs": ("True", "ResolvedRefs"),
        "Programmed": ("True", "Programmed"),
    }
    for route in ("primary", "secondary", "echo"):
        (entry,) = t.route_parents[(APPS, route)]
        assert entry["controllerName"] == GATEWAY_CONTROLLER_NAME
        assert entry["parentRef"]["name"] == "gw"
        assert conditions(entry) == {
            "Accepted": ("True", "Accepted"),
            "ResolvedRefs": ("True", "ResolvedRefs"),
        }
    for name in ("primary", "secondary"):
        (entry,) = t.pool_parents[(APPS, name)]
        assert entry["parentRef"] == {
            "group": "gateway.networking.k8s.io",
            "kind": "Gateway",
            "namespace": INFRA,
            "name": "gw",
        }
        assert conditions(entry) == {
            "Accepted": ("True", "Accepted"),
            "ResolvedRefs": ("True", "ResolvedRefs"),
        }


def test_every_condition_carries_generation_and_time() -> None:
    t = run()
    entries = [
        *t.gateway_class_status.values(),
        *t.gateway_status.values(),
        *t.gateway_status[GW]["listeners"],
        *(e for es in t.route_parents.values() for e in es),
        *(e for es in t.pool_parents.values() for e in es),
    ]
    for entry in entries:
        for cond in entry["conditions"]:
            assert cond["observedGeneration"] == 1
            assert cond["lastTransitionTime"] == NOW


def test_snapshot_holds_listener_routes_and_every_named_cluster() -> None:
    t = run()
    assert set(resources(t, LISTENER_TYPE)) == {"http-80"}
    assert set(resources(t, CLUSTER_TYPE)) == {
        "pool/apps/primary",
        "pool/apps/secondary",
        "epp/apps/primary-epp/9002",
        "epp/apps/secondary-epp/9002",
        "service/apps/echo/8080",
    }
    assert set(resources(t, ENDPOINT_TYPE)) == set(resources(t, CLUSTER_TYPE))


def test_pool_route_points_ext_proc_at_the_pools_epp() -> None:
    t = run()
    (primary,) = [
        r for r in vhost(t, "primary.example.com") if r["name"].startswith("apps/primary")
    ]
    assert primary["route"]["cluster"] == "pool/apps/primary"
    override = primary["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]
    assert override["grpc_service"]["envoy_grpc"]["cluster_name"] == "epp/apps/primary-epp/9002"
    assert override["failure_mode_allow"] is False
    (secondary,) = [r for r in vhost(t, "*") if r["name"].startswith("apps/secondary")]
    override = secondary["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]
    assert override["failure_mode_allow"] is True


def test_service_route_leaves_ext_proc_off() -> None:
    t = run()
    (echo,) = [r for r in vhost(t, "*") if r["name"].startswith("apps/echo")]
    assert echo["route"]["cluster"] == "service/apps/echo/8080"
    assert "typed_per_filter_config" not in echo
    listener = resources(t, LISTENER_TYPE)["http-80"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    assert ext_proc["disabled"] is True
    assert ext_proc["typed_config"]["route_cache_action"] == "RETAIN"


@pytest.mark.parametrize(
    ("cluster", "endpoints"),
    [
        ("pool/apps/primary", {("10.0.1.1", 3000), ("10.0.1.2", 3000), ("10.0.1.3", 3000)}),
        ("epp/apps/primary-epp/9002", {("10.0.3.1", 9002)}),
        ("epp/apps/secondary-epp/9002", {("10.0.3.2", 9002)}),  # named targetPort
        ("service/apps/echo/8080", {("10.0.4.1", 3000)}),
    ],
)
def test_endpoints_come_from_ready_pods(cluster: str, endpoints: set[tuple[str, int]]) -> None:
    cla = resources(run(), ENDPOINT_TYPE)[cluster]
    got = {
        (e["endpoint"]["address"]["socket_address"]["address"],
         e["endpoint"]["address"]["socket_address"]["port_value"])
        for group in cla["endpoints"]
        for e in group["lb_endpoints"]
    }  # fmt: skip
    assert got == endpoints


def test_translation_is_deterministic() -> None:
    a, b = run(), run()
    assert a == b
