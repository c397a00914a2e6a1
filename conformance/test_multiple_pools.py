"""Several pools: each route reaches only its own pool, and an HTTPRoute splitting
traffic over two pools by weight does so, each request then routed by that pool's EPP
(GIE: HTTPRouteMultipleGatewaysDifferentPools, GatewayWeightedAcrossTwoInferencePools)."""

from __future__ import annotations

import math

import pytest

from conformance import topology as topo
from conformance.checks import eventually, selection, served_by, traffic_only_reaches
from conformance.drivers.base import Driver

pytestmark = pytest.mark.conformance


@pytest.mark.conformance("HTTPRouteMultipleGatewaysDifferentPools")
def test_each_route_reaches_only_its_pool(driver: Driver) -> None:
    every_ip = [p.ip for pool in (topo.PRIMARY_POOL, topo.SECONDARY_POOL, topo.DP_POOL)
                for p in driver.pods(pool)]  # fmt: skip
    for route, pool in (("primary", topo.PRIMARY_POOL), ("failopen", topo.SECONDARY_POOL),
                        ("dp", topo.DP_POOL)):  # fmt: skip
        own = driver.pods(pool)
        hits = traffic_only_reaches(
            driver, route, selection(*every_ip), {p.name: () for p in own}, total=30
        )
        assert sum(hits.values()) == 30


@pytest.mark.conformance("HTTPRouteMultipleGatewaysDifferentPools")
def test_a_pod_of_another_pool_is_never_picked(driver: Driver) -> None:
    """Naming only another pool's pod leaves the EPP no candidate: 503, nothing reached."""
    stranger = driver.pods(topo.SECONDARY_POOL)[0]
    reply = driver.send("primary", headers=selection(stranger.ip))
    assert reply.status == 503 and reply.pod is None, reply


@pytest.mark.conformance("GatewayWeightedAcrossTwoInferencePools")
def test_weighted_split_across_two_pools(driver: Driver) -> None:
    total, primary_weight, secondary_weight = 200, 70, 30
    primary = {p.name for p in driver.pods(topo.PRIMARY_POOL)}
    secondary = {p.name for p in driver.pods(topo.SECONDARY_POOL)}
    # Warm every pod up through the weighted route (retrying until the split picks its pool).
    for pod in driver.pods(topo.PRIMARY_POOL) + driver.pods(topo.SECONDARY_POOL):
        eventually(
            driver, "weighted", headers=selection(pod.endpoint(3000)),
            body={"model": "conformance-fake-model", "prompt": "Warmup"},
            expect=served_by(pod.name),
            what=f"a 200 from {pod.name}",
        )  # fmt: skip
    union = selection(
        *(p.ip for p in driver.pods(topo.PRIMARY_POOL) + driver.pods(topo.SECONDARY_POOL))
    )
    hits = traffic_only_reaches(
        driver, "weighted", union, {name: () for name in primary | secondary},
        total=total, concurrency=5,
    )  # fmt: skip
    primary_hits = sum(n for key, n in hits.items() if key.split(":")[0] in primary)
    observed = primary_hits / total
    expected = primary_weight / (primary_weight + secondary_weight)
    # GIE's bound: 4.5 sigma (false failures below 0.001%), at least ±0.10.
    tolerance = max(0.10, 4.5 * math.sqrt(expected * (1 - expected) / total))
    assert abs(observed - expected) <= tolerance, (
        f"primary share {observed:.3f} ({primary_hits}/{total}), expected {expected:.3f} ± {tolerance:.3f}"
    )
