"""The endpoint that actually served is reported back on the response path
(GIE: GatewayDestinationEndpointServed)."""

from __future__ import annotations

import pytest

from conformance import topology as topo
from conformance.checks import eventually, selection, served_by
from conformance.drivers.base import Driver

pytestmark = pytest.mark.conformance


@pytest.mark.conformance("GatewayDestinationEndpointServed")
def test_gateway_reports_the_served_endpoint_to_the_epp(driver: Driver) -> None:
    """The gateway tells the EPP (metadata ``envoy.lb`` / x-gateway-destination-endpoint-served)
    which endpoint served; GIE's verifier plugin in the EPP echoes it back."""
    for pod in driver.pods(topo.PRIMARY_POOL):
        reply = eventually(
            driver, "primary", headers=selection(pod.ip),
            expect=served_by(pod.name),
            what=f"a 200 from {pod.name}",
        )  # fmt: skip
        reported = reply.headers.get(topo.VERIFIER_HEADER, "")
        assert reported == pod.endpoint(3000), reply.headers


@pytest.mark.conformance("EPPReportsServedEndpoint")
def test_response_names_the_endpoint_that_served(driver: Driver) -> None:
    """The EPP adds ``x-gateway-destination-endpoint-served`` to every routed response,
    and it names the pod and rank that really answered."""
    for route, pool in (("primary", topo.PRIMARY_POOL), ("dp", topo.DP_POOL)):
        for pod in driver.pods(pool):
            for port in pod.ports:
                reply = eventually(
                    driver, route, headers=selection(pod.endpoint(port)),
                    expect=lambda r: r.status == 200, what="a 200",
                )  # fmt: skip
                assert reply.served == pod.endpoint(port), reply
                assert reply.headers.get(topo.SERVED_HEADER) == reply.served, reply.headers
