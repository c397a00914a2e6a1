"""Routing follows the EPP: the gateway sends each request exactly where the Endpoint
Picker says (GIE: GatewayFollowingEPPRouting, ...WithDataParallelism), including the
fallback list of the Endpoint Picker Protocol."""

from __future__ import annotations

import pytest

from conformance import topology as topo
from conformance.checks import eventually, selection, served_by, traffic_only_reaches
from conformance.drivers.base import STOP_PODS, Driver

pytestmark = pytest.mark.conformance


@pytest.mark.conformance("GatewayFollowingEPPRouting")
def test_each_pod_can_be_pinned(driver: Driver) -> None:
    pods = driver.pods(topo.PRIMARY_POOL)
    assert len(pods) == 3
    for pod in pods:
        reply = eventually(
            driver, "primary", headers=selection(pod.ip),
            expect=served_by(pod.name),
            what=f"a 200 from {pod.name}",
        )  # fmt: skip
        assert reply.echo["path"] == topo.ROUTES["primary"].path
        assert reply.echo["model"] == topo.REQUEST_BODY["model"]


@pytest.mark.conformance("GatewayFollowingEPPRouting")
@pytest.mark.parametrize(
    "picked",
    [(2,), (0, 1), (0, 1, 2)],
    ids=["single designated pod", "two designated pods", "all pods"],
)
def test_traffic_only_reaches_the_picked_pods(driver: Driver, picked: tuple[int, ...]) -> None:
    pods = driver.pods(topo.PRIMARY_POOL)
    chosen = [pods[i] for i in picked]
    hits = traffic_only_reaches(
        driver, "primary", selection(*(p.ip for p in chosen)), {p.name: () for p in chosen}
    )
    assert sum(hits.values()) == 100


@pytest.mark.conformance("GatewayFollowingEPPRoutingWithDataParallelism")
@pytest.mark.parametrize(
    "allowed",
    [
        {1: ()},
        {0: (), 2: (3002,)},
        {0: (), 1: (3000, 3004), 2: ()},
    ],
    ids=["one pod any rank", "two pods one fixed rank", "all pods one restricted"],
)
def test_data_parallel_ranks(driver: Driver, allowed: dict[int, tuple[int, ...]]) -> None:
    pods = driver.pods(topo.DP_POOL)
    assert [p.ports for p in pods] == [(3000, 3002, 3004)] * 3
    for pod in pods:  # every pod answers when pinned by IP alone
        eventually(
            driver, "dp", headers=selection(pod.ip),
            expect=served_by(pod.name),
            what=f"a 200 from {pod.name}",
        )  # fmt: skip
    header: list[str] = []
    for index, ports in sorted(allowed.items()):
        pod = pods[index]
        header += [pod.endpoint(p) for p in ports] if ports else [pod.ip]
    hits = traffic_only_reaches(
        driver, "dp", selection(*header),
        {pods[i].name: ports or pods[i].ports for i, ports in allowed.items()},
    )  # fmt: skip
    assert sum(hits.values()) == 100


@pytest.mark.conformance("GatewayFollowingEPPRoutingWithDataParallelism")
def test_an_unlisted_rank_is_never_used(driver: Driver) -> None:
    """Pinning ``ip:port`` selects that rank only: every request lands on it."""
    pod = driver.pods(topo.DP_POOL)[0]
    hits = traffic_only_reaches(
        driver, "dp", selection(pod.endpoint(3004)), {pod.name: (3004,)}, total=30
    )
    assert hits == {f"{pod.name}:3004": 30}


@pytest.mark.conformance("GatewayEPPFallbackList")
def test_first_endpoint_of_the_list_serves(driver: Driver) -> None:
    """The EPP answers ``first,second``: the gateway must use the first valid endpoint."""
    first, second, _ = driver.pods(topo.FALLBACK_POOL)
    reply = driver.send("fallback", headers=selection(first.ip, second.ip))
    assert reply.status == 200, reply
    assert reply.pod == first.name, reply


@pytest.mark.conformance("GatewayEPPFallbackList")
def test_fallback_endpoint_serves_when_the_first_is_down(driver: Driver) -> None:
    """GIE: "if retry is configured, the proxy will go sequentially down the list"."""
    if STOP_PODS not in driver.capabilities:
        pytest.skip(f"the {driver.name} driver cannot stop a single pod behind the EPP's back")
    first, second, _ = driver.pods(topo.FALLBACK_POOL)
    with driver.pod_stopped(first):
        reply = driver.send("fallback", headers=selection(first.ip, second.ip))
    assert reply.status == 200, reply
    assert reply.pod == second.name, reply
