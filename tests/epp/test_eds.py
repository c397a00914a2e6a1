"""The EPP's EDS service: what Envoy's pool cluster learns its endpoints from.

Driven over real gRPC the way Envoy drives a state-of-the-world stream: subscribe,
ACK each version, expect a push when the endpoint set changes and silence otherwise.
"""

from __future__ import annotations

import asyncio

import grpc
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from infergate.epp.server.eds import TYPE_URL
from infergate.epp.types import Endpoint

CLUSTER = "infergate_pool"


def _hosts(response: discovery_pb2.DiscoveryResponse) -> dict[str, list[str]]:
    out = {}
    for resource in response.resources:
        assignment = endpoint_pb2.ClusterLoadAssignment()
        assert resource.Unpack(assignment)
        out[assignment.cluster_name] = [
            f"{e.endpoint.address.socket_address.address}:"
            f"{e.endpoint.address.socket_address.port_value}"
            for locality in assignment.endpoints
            for e in locality.lb_endpoints
        ]
    return out


def _request(names: list[str], ack: discovery_pb2.DiscoveryResponse | None = None) -> object:
    return discovery_pb2.DiscoveryRequest(
        type_url=TYPE_URL,
        resource_names=names,
        version_info=ack.version_info if ack else "",
        response_nonce=ack.nonce if ack else "",
    )


async def test_subscription_gets_the_pool_then_every_change(epp_factory, channel_for) -> None:
    epp = await epp_factory(
        static_endpoints=[Endpoint("127.0.0.2", 8000), Endpoint("127.0.0.1", 8001)]
    )
    call = eds_pb2_grpc.EndpointDiscoveryServiceStub(channel_for(epp)).StreamEndpoints()
    await call.write(_request([CLUSTER]))
    first = await asyncio.wait_for(call.read(), 10)
    assert first.type_url == TYPE_URL
    assert _hosts(first) == {CLUSTER: ["127.0.0.1:8001", "127.0.0.2:8000"]}

    # An ACK of what was sent gets no answer (else the next message would repeat the
    # first set); a change does, even unasked.
    await call.write(_request([CLUSTER], ack=first))
    await asyncio.sleep(0.3)
    epp.datastore.set_endpoints([Endpoint("127.0.0.3", 9000)])
    second = await asyncio.wait_for(call.read(), 10)
    assert _hosts(second) == {CLUSTER: ["127.0.0.3:9000"]}
    assert second.version_info != first.version_info
    assert second.nonce != first.nonce

    # A NACK is logged, not answered; a new resource name is answered at once.
    nack = _request([CLUSTER], ack=second)
    nack.error_detail.message = "rejected for the test"  # type: ignore[attr-defined]
    await call.write(nack)
    await call.write(_request([CLUSTER, "other"], ack=second))
    third = await asyncio.wait_for(call.read(), 10)
    assert set(_hosts(third)) == {CLUSTER, "other"}
    await call.done_writing()
    assert await asyncio.wait_for(call.read(), 10) is grpc.aio.EOF


async def test_empty_pool_is_announced_as_empty(epp_factory, channel_for) -> None:
    epp = await epp_factory()
    call = eds_pb2_grpc.EndpointDiscoveryServiceStub(channel_for(epp)).StreamEndpoints()
    await call.write(_request([CLUSTER]))
    response = await asyncio.wait_for(call.read(), 10)
    assert _hosts(response) == {CLUSTER: []}
    call.cancel()
    # The EPP keeps serving others after a subscriber vanishes.
    again = eds_pb2_grpc.EndpointDiscoveryServiceStub(channel_for(epp)).StreamEndpoints()
    await again.write(_request([CLUSTER]))
    assert _hosts(await asyncio.wait_for(again.read(), 10)) == {CLUSTER: []}
    again.cancel()
