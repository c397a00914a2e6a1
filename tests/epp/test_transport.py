"""Both ext-proc servers (``--grpc-server h2`` and ``aio``) serve the same port contract:
ext-proc, gRPC health and EDS; the h2 one answers unknown methods UNIMPLEMENTED and
carries a large body (many frames, flow control) back unchanged."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from infergate.epp.types import Endpoint

from .conftest import Stream, body, headers, set_headers

POST = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}
A = Endpoint("127.0.0.1", 18001)


@pytest.mark.parametrize("server", ["h2", "aio"])
async def test_ext_proc_health_and_eds_on_one_port(epp_factory, channel_for, server) -> None:
    epp = await epp_factory(static_endpoints=[A], grpc_server=server)
    channel = channel_for(epp)
    stream = Stream(channel)
    payload = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}).encode()
    await stream.send(headers(POST), body(payload))
    header_response, echoed = await stream.recv(2)
    assert set_headers(header_response)["x-gateway-destination-endpoint"] == A.key
    assert echoed.request_body.response.body_mutation.streamed_response.body == payload
    await stream.close()

    check = health_pb2_grpc.HealthStub(channel).Check
    reply = await check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await check(health_pb2.HealthCheckRequest(service="no-such-service"), timeout=5)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

    eds = eds_pb2_grpc.EndpointDiscoveryServiceStub(channel).StreamEndpoints()
    await eds.write(discovery_pb2.DiscoveryRequest(resource_names=["pool"]))
    assignment = await asyncio.wait_for(eds.read(), 5)
    assert assignment.resources and assignment.version_info
    eds.cancel()
    await asyncio.sleep(0.05)
    assert epp.ext_proc.active_streams == 0


async def test_h2_unknown_method_is_unimplemented(epp_factory, channel_for) -> None:
    epp = await epp_factory(static_endpoints=[A], grpc_server="h2")
    call = channel_for(epp).unary_unary("/no.Such/Method")
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call(b"", timeout=5)
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_h2_large_body_comes_back_unchanged(epp_factory, channel_for) -> None:
    epp = await epp_factory(static_endpoints=[A], grpc_server="h2")
    stream = Stream(channel_for(epp))
    payload = json.dumps({"model": "m", "prompt": "x" * (600 << 10)}).encode()
    chunks = [payload[i : i + (16 << 10)] for i in range(0, len(payload), 16 << 10)]
    await stream.send(headers(POST))
    await stream.send(*(body(c, i == len(chunks) - 1) for i, c in enumerate(chunks)))
    _, *echoed = await stream.recv(1 + len(chunks))
    streamed = [e.request_body.response.body_mutation.streamed_response for e in echoed]
    assert b"".join(s.body for s in streamed) == payload
    assert [s.end_of_stream for s in streamed][-1]
    await stream.close()
