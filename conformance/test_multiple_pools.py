"""Several pools: routes on two Gateways each reach only their pool, two rules of one
route reach two pools by path, and one rule splits traffic over two pools by weight,
each request then routed by the chosen pool's EPP (GIE:
HTTPRouteMultipleGatewaysDifferentPools, HTTPRouteMultipleRulesDifferentPools,
GatewayWeightedAcrossTwoInferencePools)."""

from __future__ import annotations

import math

import pytest

from conformance import topology as topo
from conformance.checks import (
    Expected,
    applied,
    eventually,
    pods,
    pool_must_be_accepted_by,
    post,
    route_must_be_accepted_and_resolved,
    traffic_only_reaches,
)
from conformance.drivers.base import Driver, Reply, Request

pytestmark = pytest.mark.conformance


@pytest.mark.conformance("HTTPRouteMultipleGatewaysDifferentPools")
def test_multiple_gateways_different_pools(
    driver: Driver, primary_address: str, secondary_address: str
) -> None:
    """Plain GETs (no test header: the EPP may pick any pod of its pool) on each
    Gateway reach only that route's pool."""
    with applied(driver, "httproute_multiple_gateways_different_pools"):
        for route, gateway, pool, address, host, path, app in (
            ("route-for-primary-gateway", topo.PRIMARY_GATEWAY, topo.PRIMARY_POOL,
             primary_address, "primary.example.com", "/test-primary-gateway", topo.PRIMARY_APP),
            ("route-for-secondary-gateway", topo.SECONDARY_GATEWAY, topo.SECONDARY_POOL,
             secondary_address, "secondary.example.com", "/test-secondary-gateway", topo.SECONDARY_APP),
        ):  # fmt: skip
            route_must_be_accepted_and_resolved(driver, route, gateway)
            pool_must_be_accepted_by(driver, pool, gateway)
            eventually(driver, address, Request(path, host), Expected(backend=app))


@pytest.mark.conformance("HTTPRouteMultipleGatewaysDifferentPools")
def test_a_pod_of_another_pool_is_never_picked(driver: Driver, primary_address: str) -> None:
    """infergate's addition: naming only another pool's pod leaves the EPP no candidate,
    so the request fails and reaches nothing (never the other pool's pod)."""
    with applied(driver, "httproute_multiple_gateways_different_pools"):
        route_must_be_accepted_and_resolved(
            driver, "route-for-primary-gateway", topo.PRIMARY_GATEWAY
        )
        stranger = pods(driver, topo.SECONDARY_APP)[0]
        request = post("/test-primary-gateway", "primary.example.com")
        eventually(driver, primary_address, request, Expected(backend=topo.PRIMARY_APP))
        reply = driver.send(
            primary_address, post("/test-primary-gateway", "primary.example.com", stranger.ip)
        )
        assert reply.status >= 500 and reply.pod is None, reply


@pytest.mark.conformance("HTTPRouteMultipleRulesDifferentPools")
def test_multiple_rules_different_pools(driver: Driver, primary_address: str) -> None:
    with applied(driver, "inferencepool_multiple_rules_different_pools"):
        route = "httproute-multiple-rules-different-pools"
        for pool in (topo.PRIMARY_POOL, topo.SECONDARY_POOL):
            route_must_be_accepted_and_resolved(driver, route, topo.PRIMARY_GATEWAY)
            pool_must_be_accepted_by(driver, pool, topo.PRIMARY_GATEWAY)
        eventually(driver, primary_address, Request("/primary"), Expected(backend=topo.PRIMARY_APP))
        eventually(
            driver, primary_address, Request("/secondary"), Expected(backend=topo.SECONDARY_APP)
        )


@pytest.mark.conformance("GatewayWeightedAcrossTwoInferencePools")
def test_weighted_split_across_two_pools(driver: Driver, primary_address: str) -> None:
    """70/30 backendRef weights over two pools, 200 requests 5 at a time naming every
    pod of both pools: the primary share within GIE's bound (4.5 σ, at least ±0.10)."""
    host, path, total = "primary.example.com", "/weighted-two-pools-test", 200
    with applied(driver, "gateway_weighted_two_pools"):
        route_must_be_accepted_and_resolved(
            driver, "httproute-weighted-two-pools", topo.PRIMARY_GATEWAY
        )
        for pool in (topo.PRIMARY_POOL, topo.SECONDARY_POOL):
            pool_must_be_accepted_by(driver, pool, topo.PRIMARY_GATEWAY)
        primary, secondary = pods(driver, topo.PRIMARY_APP), pods(driver, topo.SECONDARY_APP)
        assert len(primary) == len(secondary) == topo.MODEL_SERVER_REPLICAS
        warmup = {"model": "conformance-fake-model", "prompt": "Warmup"}
        for pod in primary + secondary:  # each pod, through whichever pool the split picks
            eventually(driver, primary_address, post(path, host, pod.endpoint(3000), warmup),
                       Expected(backend=pod.name), skip=_sent_to_the_other_pool)  # fmt: skip
        union = post(path, host, ",".join(p.ip for p in primary + secondary))
        hits = traffic_only_reaches(
            driver, primary_address, union, {p.name: () for p in primary + secondary},
            total=total, concurrency=5,
        )  # fmt: skip
        names = {p.name for p in primary}
        primary_hits = sum(n for key, n in hits.items() if key.split(":")[0] in names)
        observed, expected = primary_hits / total, 70 / (70 + 30)
        tolerance = max(0.10, 4.5 * math.sqrt(expected * (1 - expected) / total))
        assert abs(observed - expected) <= tolerance, (
            f"primary share {observed:.3f} ({primary_hits}/{total}), expected {expected:.3f} ± {tolerance:.3f}"
        )


def _sent_to_the_other_pool(reply: Reply) -> bool:
    """The split chose the pool this pod is not in: that pool's EPP, asked for a pod it
    does not have, fails the request before any pod (a 5xx no pod answered). A warm-up
    needs three picks of the pod's own pool in a row only, not three of the split's
    draws (0.3³ a try for the 30 % pool, ~50 tries a pod)."""
    return reply.status >= 500 and reply.pod is None
