"""Routing follows the EPP: a Gateway sends each request exactly where the Endpoint
Picker says (GIE: GatewayFollowingEPPRouting, GatewayFollowingEPPRoutingWithDataParallelism),
including the fallback list of the Endpoint Picker Protocol (infergate's
GatewayEPPFallbackList)."""

from __future__ import annotations

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
from conformance.drivers.base import STOP_PODS, Driver

pytestmark = pytest.mark.conformance

HOST = "primary.example.com"


@pytest.mark.conformance("GatewayFollowingEPPRouting")
def test_gateway_following_epp_routing(driver: Driver, primary_address: str) -> None:
    """Each pod can be pinned; then 100 requests (10 at a time) reach only the one, two
    or three pods the EPP is told to pick from."""
    path = "/primary-gateway-test"
    with applied(driver, "gateway_following_epp_routing"):
        route_must_be_accepted_and_resolved(
            driver, "httproute-for-primary-gw", topo.PRIMARY_GATEWAY
        )
        pool_must_be_accepted_by(driver, topo.PRIMARY_POOL, topo.PRIMARY_GATEWAY)
        backends = pods(driver, topo.PRIMARY_APP)
        assert len(backends) == topo.MODEL_SERVER_REPLICAS
        for pod in backends:
            reply = eventually(
                driver, primary_address, post(path, HOST, pod.ip), Expected(backend=pod.name)
            )
            assert reply.echo["model"] == topo.REQUEST_BODY["model"]
        for picked in ((2,), (0, 1), (0, 1, 2)):
            chosen = [backends[i] for i in picked]
            request = post(path, HOST, ",".join(p.ip for p in chosen))
            hits = traffic_only_reaches(
                driver, primary_address, request, {p.name: () for p in chosen}
            )
            assert sum(hits.values()) == 100, hits


@pytest.mark.conformance("GatewayFollowingEPPRoutingWithDataParallelism")
@pytest.mark.parametrize(
    "allowed",
    [{1: ()}, {0: (), 2: (3002,)}, {0: (), 1: (3000, 3004), 2: ()}],
    ids=["one pod any rank", "two pods one fixed rank", "all pods one restricted"],
)
def test_data_parallel_ranks(
    driver: Driver, primary_address: str, allowed: dict[int, tuple[int, ...]]
) -> None:
    """Three pods × ranks 3000/3002/3004: an IP lets the EPP pick any rank of that pod,
    ``ip:port`` only that rank; the echo body says which rank answered."""
    path = "/primary-gateway-dp-test"
    with applied(driver, "gateway_following_epp_routing_dp"):
        route_must_be_accepted_and_resolved(
            driver, "httproute-for-primary-gw-dp", topo.PRIMARY_GATEWAY
        )
        pool_must_be_accepted_by(driver, topo.DP_POOL, topo.PRIMARY_GATEWAY)
        backends = pods(driver, topo.DP_APP)
        assert [p.ports for p in backends] == [(3000, 3002, 3004)] * 3
        for pod in backends:
            eventually(
                driver, primary_address, post(path, HOST, pod.ip), Expected(backend=pod.name)
            )
        tokens: list[str] = []
        for index, ports in sorted(allowed.items(), key=lambda item: backends[item[0]].ip):
            pod = backends[index]
            tokens += [pod.endpoint(p) for p in sorted(ports)] if ports else [pod.ip]
        hits = traffic_only_reaches(
            driver, primary_address, post(path, HOST, ",".join(tokens)),
            {backends[i].name: ports or backends[i].ports for i, ports in allowed.items()},
        )  # fmt: skip
        assert sum(hits.values()) == 100, hits


@pytest.mark.conformance("GatewayEPPFallbackList")
def test_fallback_list(driver: Driver, primary_address: str) -> None:
    """The EPP answers ``first,second``: the first serves; with the first down (its
    process stopped, the API still says Running) the gateway walks on to the second —
    GIE: "if retry is configured, the proxy will go sequentially down the list"."""
    path = "/fallback-pool-test"
    with applied(driver, "gateway_epp_fallback_list"):
        route_must_be_accepted_and_resolved(
            driver, "httproute-for-fallback-pool", topo.PRIMARY_GATEWAY
        )
        first, second, _ = pods(driver, topo.PRIMARY_APP)
        request = post(path, HOST, f"{first.ip},{second.ip}")
        eventually(driver, primary_address, request, Expected(backend=first.name))
        if STOP_PODS not in driver.capabilities:
            pytest.skip(f"the {driver.name} driver cannot stop one pod behind the EPP's back")
        with driver.pod_stopped(first):
            reply = driver.send(primary_address, request)
        assert reply.status == 200 and reply.pod == second.name, reply
