"""The Endpoint Picker is unavailable: a FailOpen pool keeps serving (GIE:
EppUnAvailableFailOpen), a FailClose pool — the API's default — answers 5xx and reaches
no pod (infergate's EppUnAvailableFailClose). The picker is made unavailable as GIE does
it: its Service's selector is changed until its EndpointSlices are empty, so the Gateway
learns it through the API server, as in a cluster.

GIE v1.6.0's test empties the *primary* pool's picker Service while it sends to the
secondary (FailOpen) pool; this port empties the secondary pool's own picker, which is
what the test is about (the primary pool's picker is emptied in the FailClose case)."""

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
    service_unavailable,
)
from conformance.drivers.base import Driver, Request

pytestmark = pytest.mark.conformance


@pytest.mark.conformance("EppUnAvailableFailOpen")
def test_fail_open_pool_keeps_serving(driver: Driver, secondary_address: str) -> None:
    host, path = "secondary.example.com", "/failopen-pool-test"
    with applied(driver, "epp_unavailable_fail_open"):
        route_must_be_accepted_and_resolved(
            driver, "httproute-for-failopen-pool-gw", topo.SECONDARY_GATEWAY
        )
        pool_must_be_accepted_by(driver, topo.SECONDARY_POOL, topo.SECONDARY_GATEWAY)
        backends = pods(driver, topo.SECONDARY_APP)
        assert len(backends) == topo.MODEL_SERVER_REPLICAS
        target = backends[0]
        request = post(path, host, target.ip)
        # Phase 1: with the EPP up, the pinned pod serves.
        eventually(driver, secondary_address, request, Expected(backend=target.name))
        # Phase 2: the EPP gone, requests still succeed, from some pod of the pool.
        with service_unavailable(driver, topo.pools()[topo.SECONDARY_POOL].picker_service):
            eventually(driver, secondary_address, request, Expected(backend=topo.SECONDARY_APP))
            get = Request(path, host, "GET", headers={topo.SELECTION_HEADER: target.ip})
            eventually(driver, secondary_address, get, Expected(backend=topo.SECONDARY_APP))
            for _ in range(10):
                reply = driver.send(secondary_address, request)
                assert reply.status == 200 and str(reply.pod).startswith(topo.SECONDARY_APP), reply
        # The EPP is back: routing follows it again.
        eventually(
            driver,
            secondary_address,
            post(path, host, backends[1].ip),
            Expected(backend=backends[1].name),
        )


@pytest.mark.conformance("EppUnAvailableFailClose")
def test_fail_close_pool_fails(driver: Driver, primary_address: str) -> None:
    host, path = "primary.example.com", "/failclose-pool-test"
    with applied(driver, "epp_unavailable_fail_close"):
        route_must_be_accepted_and_resolved(
            driver, "httproute-for-failclose-pool-gw", topo.PRIMARY_GATEWAY
        )
        backends = pods(driver, topo.PRIMARY_APP)
        request = post(path, host, backends[0].ip)
        eventually(driver, primary_address, request, Expected(backend=backends[0].name))
        with service_unavailable(driver, topo.pools()[topo.PRIMARY_POOL].picker_service):
            eventually(driver, primary_address, request, Expected(statuses=tuple(range(500, 600))))
            for _ in range(10):
                reply = driver.send(primary_address, request)
                assert reply.status >= 500 and reply.pod is None, reply
        eventually(
            driver,
            primary_address,
            post(path, host, backends[1].ip),
            Expected(backend=backends[1].name),
        )
