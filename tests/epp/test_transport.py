"""Both ext-proc servers (``--grpc-server h2`` and ``aio``) serve the same port contract:
ext-proc, gRPC health and EDS; the h2 one answers unknown methods UNIMPLEMENTED and
carries a large body (many frames, flow control) back unchanged."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any

import grpc
import pytest
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
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


def test_the_native_transport_is_built_and_the_default() -> None:
    """``make install`` builds native/grpc_h2; without it the EPP would fall back to aio."""
    import infergate.epp._grpc_h2 as native
    from infergate.epp.options import EppOptions

    assert EppOptions().grpc_server == "h2"
    assert callable(native.GrpcConnection)


PROCESS = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"


class RawClient:
    """A gRPC client written by hand with the ``h2`` package: what the native transport
    does at the HTTP/2 level (windows, resets, trailers) is seen frame by frame."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import h2.config
        import h2.connection

        self.reader, self.writer = reader, writer
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.h2.initiate_connection()
        self.data = bytearray()  # the stream's DATA: gRPC-framed ProcessingResponses
        self.headers: dict[bytes, bytes] = {}

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        """Connected, with the EPP's settings and connection window (16 MiB) taken in."""
        client = cls(*await asyncio.open_connection("127.0.0.1", port))
        client.writer.write(client.h2.data_to_send())
        while (
            client.h2.outbound_flow_control_window < 1 << 20
            or client.h2.remote_settings.initial_window_size < 1 << 20
        ):
            data = await asyncio.wait_for(client.reader.read(65536), 5)
            assert data, "the EPP closed the connection during the handshake"
            client.h2.receive_data(data)
            client.writer.write(client.h2.data_to_send())
        return client

    def call(self, frames: bytes, end_stream: bool = True) -> None:
        request = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", PROCESS),
            (b":authority", b"epp"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]
        self.h2.send_headers(1, request)
        self.h2.send_data(1, frames, end_stream=end_stream)
        self.writer.write(self.h2.data_to_send())

    async def until_ended(self, pause: float = 0.0) -> dict[bytes, bytes]:
        """Read until stream 1 ends (its response headers and trailers merged); acknowledge
        DATA as it is read, ``pause`` seconds after each read (a slow reader)."""
        import h2.events

        while True:
            data = await asyncio.wait_for(self.reader.read(65536), 5)
            assert data, f"connection closed before the stream ended; headers {self.headers}"
            for event in self.h2.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    self.headers.update(dict(event.headers))
                elif isinstance(event, h2.events.DataReceived):
                    self.data += event.data
                    self.h2.acknowledge_received_data(event.flow_controlled_length, 1)
                elif isinstance(event, h2.events.StreamEnded):
                    self.writer.write(self.h2.data_to_send())
                    return self.headers
            self.writer.write(self.h2.data_to_send())
            await asyncio.sleep(pause)

    def responses(self) -> list[pb.ProcessingResponse]:
        out, view = [], memoryview(self.data)
        while view:
            size = int.from_bytes(view[1:5], "big")
            out.append(pb.ProcessingResponse.FromString(bytes(view[5 : 5 + size])))
            view = view[5 + size :]
        return out

    def close(self) -> None:
        self.writer.close()


def _grpc(*messages: pb.ProcessingRequest) -> bytes:
    return b"".join(
        b"\0" + len(raw).to_bytes(4, "big") + raw
        for raw in (message.SerializeToString() for message in messages)
    )


async def _raw_call(port: int, frames: bytes) -> dict[bytes, bytes]:
    client = await RawClient.connect(port)
    try:
        client.call(frames)
        return await client.until_ended()
    finally:
        client.close()


async def test_h2_refuses_a_message_over_the_limit_and_a_compressed_one(epp_factory) -> None:
    epp = await epp_factory(static_endpoints=[A], grpc_server="h2")
    too_large = (0).to_bytes(1, "big") + (100 << 20).to_bytes(4, "big") + b"x" * 100
    answer = await _raw_call(epp.grpc_port, too_large)
    assert answer[b"grpc-status"] == str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]).encode()
    assert b"over the limit" in answer[b"grpc-message"]
    compressed = (1).to_bytes(1, "big") + (3).to_bytes(4, "big") + b"abc"
    answer = await _raw_call(epp.grpc_port, compressed)
    assert answer[b"grpc-status"] == str(grpc.StatusCode.UNIMPLEMENTED.value[0]).encode()
    assert epp.ext_proc.active_streams == 0


async def test_h2_garbage_closes_that_connection_only(epp_factory, channel_for) -> None:
    epp = await epp_factory(static_endpoints=[A], grpc_server="h2")
    reader, writer = await asyncio.open_connection("127.0.0.1", epp.grpc_port)
    writer.write(b"GET / HTTP/1.1\r\nHost: epp\r\n\r\n" + bytes(range(256)) * 4)
    received = b""
    while chunk := await asyncio.wait_for(reader.read(65536), 5):
        received += chunk
    writer.close()
    assert received[3] == 0x04  # the server's SETTINGS, then it closed (EOF above)
    check = health_pb2_grpc.HealthStub(channel_for(epp)).Check
    reply = await check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_handler_has_its_task_before_it_first_suspends() -> None:
    """What the precise prefix scorer's aiohttp timeouts need: ``step_in_place`` runs a
    coroutine's first step now, with the task that finishes it already current."""
    from infergate.epp.server.h2 import step_in_place

    seen: list[asyncio.Task[object] | None] = []

    async def waits() -> str:
        seen.append(asyncio.current_task())
        async with asyncio.timeout(5):  # needs a current task
            await asyncio.sleep(0.01)
        seen.append(asyncio.current_task())
        return "later"

    async def returns() -> str:
        seen.append(asyncio.current_task())
        return "now"

    async def from_a_callback(coro: Coroutine[Any, Any, str]) -> tuple[Any, ...]:
        """As the h2 server calls it: from a protocol or loop callback, not a task."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[tuple[Any, ...]] = loop.create_future()
        loop.call_soon(lambda: done.set_result((*step_in_place(coro), asyncio.current_task())))
        return await done

    task, step, result, after = await from_a_callback(returns())
    assert step.done and result == "now" and seen == [task] and after is None
    seen.clear()
    task, step, result, after = await from_a_callback(waits())
    assert not step.done and seen == [task] and after is None
    assert await task == "later" and seen == [task, task]


async def test_h2_a_slow_reader_with_a_small_window_gets_the_whole_echo(epp_factory) -> None:
    """The echoed body waits in the native layer for the reader's window: 16 KiB per
    stream, opened only as a slow reader acknowledges what it read."""
    import h2.settings

    epp = await epp_factory(static_endpoints=[A], grpc_server="h2")
    client = await RawClient.connect(epp.grpc_port)
    client.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 16 << 10})
    payload = json.dumps({"model": "m", "prompt": "y" * (300 << 10)}).encode()
    chunks = [payload[i : i + (16 << 10)] for i in range(0, len(payload), 16 << 10)]
    messages = [body(c, i == len(chunks) - 1) for i, c in enumerate(chunks)]
    try:
        client.call(_grpc(headers(POST), *messages))
        trailers = await client.until_ended(pause=0.002)
    finally:
        client.close()
    assert trailers[b"grpc-status"] == b"0"
    header_response, *echoed = client.responses()
    assert set_headers(header_response)["x-gateway-destination-endpoint"] == A.key
    streamed = [e.request_body.response.body_mutation.streamed_response for e in echoed]
    assert b"".join(s.body for s in streamed) == payload


async def test_h2_a_stream_reset_mid_body_is_released(epp_factory) -> None:
    epp = await epp_factory(static_endpoints=[A], grpc_server="h2")
    client = await RawClient.connect(epp.grpc_port)
    try:
        client.call(_grpc(headers(POST), body(b'{"model": "m", "pro', False)), end_stream=False)
        for _ in range(100):
            if epp.ext_proc.active_streams == 1:
                break
            await asyncio.sleep(0.01)
        assert epp.ext_proc.active_streams == 1
        client.h2.reset_stream(1)
        client.writer.write(client.h2.data_to_send())
        for _ in range(100):
            if epp.ext_proc.active_streams == 0:
                break
            await asyncio.sleep(0.01)
        assert epp.ext_proc.active_streams == 0
    finally:
        client.close()
