"""The endpoint that actually served is reported back (GIE:
GatewayDestinationEndpointServed; infergate's EPPReportsServedEndpoint)."""

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
)
from conformance.drivers.base import Driver

pytestmark = pytest.mark.conformance

HOST = "primary.example.com"


@pytest.mark.conformance("GatewayDestinationEndpointServed")
def test_gateway_reports_the_served_endpoint(driver: Driver, primary_address: str) -> None:
    """The Gateway tells the EPP which endpoint served (metadata ``envoy.lb`` /
    ``x-gateway-destination-endpoint-served``); the conformance EPP's verifier echoes it
    in ``x-conformance-test-served-endpoint``."""
    path = "/destination-endpoint-served-test"
    with applied(driver, "gateway_destination_endpoint_served"):
        route = "httproute-for-destination-endpoint-served"
        route_must_be_accepted_and_resolved(driver, route, topo.PRIMARY_GATEWAY)
        pool_must_be_accepted_by(driver, topo.PRIMARY_POOL, topo.PRIMARY_GATEWAY)
        for pod in pods(driver, topo.PRIMARY_APP):
            expected = Expected(backend=pod.name, headers={topo.VERIFIER_HEADER: f"{pod.ip}:3000"})
            eventually(driver, primary_address, post(path, HOST, pod.ip), expected)


@pytest.mark.conformance("EPPReportsServedEndpoint")
def test_response_names_the_endpoint_that_served(driver: Driver, primary_address: str) -> None:
    """infergate's EPP adds ``x-gateway-destination-endpoint-served`` to every routed
    response, naming the pod and rank that really answered."""
    with applied(driver, "epp_reports_served_endpoint"):
        for route, path, app in (
            ("httproute-for-served-endpoint", "/served-endpoint-test", topo.PRIMARY_APP),
            ("httproute-for-served-endpoint-dp", "/served-endpoint-dp-test", topo.DP_APP),
        ):
            route_must_be_accepted_and_resolved(driver, route, topo.PRIMARY_GATEWAY)
            for pod in pods(driver, app):
                for port in pod.ports:
                    reply = eventually(
                        driver, primary_address, post(path, HOST, pod.endpoint(port)),
                        Expected(backend=pod.name, headers={topo.SERVED_HEADER: pod.endpoint(port)}),
                    )  # fmt: skip
                    assert reply.served == pod.endpoint(port), reply
