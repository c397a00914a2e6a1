"""Fixtures for EPP tests: an in-process EPP on free ports, real metrics servers, a gRPC client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from infergate.epp.app import Epp, EppOptions
from infergate.epp.datalayer.completions import COMPLETION_EVENTS_PORT_LABEL
from infergate.epp.types import Endpoint
from prometheus_client import CollectorRegistry, Gauge, start_http_server


class EngineMetrics:
    """A real HTTP server exposing vLLM-named metrics from a prometheus_client registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "w", ["model_name"], registry=self.registry
        )
        self.running = Gauge(
            "vllm:num_requests_running", "r", ["model_name"], registry=self.registry
        )
        self.kv = Gauge("vllm:kv_cache_usage_perc", "kv", ["model_name"], registry=self.registry)
        self.cache = Gauge(
            "vllm:cache_config_info",
            "cfg",
            ["block_size", "num_gpu_blocks"],
            registry=self.registry,
        )
        self.cache.labels("16", "1024").set(1)
        self.set(0, 0, 0.0)
        self.server, self.thread = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self.port = self.server.server_port

    def set(self, waiting: int, running: int, kv: float) -> None:
        self.waiting.labels("m").set(waiting)
        self.running.labels("m").set(running)
        self.kv.labels("m").set(kv)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=2)


@pytest.fixture
def engine_metrics() -> Iterator[Callable[[], EngineMetrics]]:
    made: list[EngineMetrics] = []

    def make() -> EngineMetrics:
        server = EngineMetrics()
        made.append(server)
        return server

    yield make
    for server in made:
        server.close()


EppFactory = Callable[..., Awaitable[Epp]]


@pytest.fixture
async def epp_factory() -> AsyncIterator[EppFactory]:
    running: list[Epp] = []

    async def make(**kwargs: Any) -> Epp:
        kwargs.setdefault("host", "127.0.0.1")
        kwargs.setdefault("grpc_port", 0)
        kwargs.setdefault("grpc_health_port", 0)
        kwargs.setdefault("metrics_port", 0)
        epp = Epp(EppOptions(**kwargs))
        await epp.start()
        running.append(epp)
        return epp

    yield make
    for epp in running:
        await epp.stop(0)


def headers(
    items: dict[str, str], end_of_stream: bool = False, metadata: dict[str, Any] | None = None
) -> pb.ProcessingRequest:
    hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in items.items()]
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=hv), end_of_stream=end_of_stream
        )
    )
    if metadata:
        for namespace, value in metadata.items():
            struct = struct_pb2.Struct()
            struct.update(value)
            message.metadata_context.filter_metadata[namespace].CopyFrom(struct)
    return message


def body(data: bytes, end_of_stream: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


def response_headers(
    items: dict[str, str], metadata: dict[str, Any] | None = None, end_of_stream: bool = False
) -> pb.ProcessingRequest:
    message = headers(items, end_of_stream, metadata)
    out = pb.ProcessingRequest(response_headers=message.request_headers)
    out.metadata_context.CopyFrom(message.metadata_context)
    return out


def response_body(data: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


class Stream:
    """One ext-proc stream driven like Envoy drives it."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call = pb_grpc.ExternalProcessorStub(channel).Process()

    async def send(self, *messages: pb.ProcessingRequest) -> None:
        for message in messages:
            await self.call.write(message)

    async def recv(self, count: int = 1, timeout: float = 10.0) -> list[pb.ProcessingResponse]:
        out = []
        for _ in range(count):
            item = await asyncio.wait_for(self.call.read(), timeout)
            assert item is not grpc.aio.EOF, "stream ended early"
            out.append(item)
        return out

    async def close(self) -> None:
        await self.call.done_writing()


@pytest.fixture
async def channel_for() -> AsyncIterator[Callable[[Epp], grpc.aio.Channel]]:
    channels: list[grpc.aio.Channel] = []

    def make(epp: Epp) -> grpc.aio.Channel:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}")
        channels.append(channel)
        return channel

    yield make
    for channel in channels:
        await channel.close()


def set_headers(response: pb.ProcessingResponse, side: str = "request_headers") -> dict[str, str]:
    mutation = getattr(response, side).response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


async def route_buffered(
    stream: Stream, items: dict[str, str], payload: bytes
) -> tuple[pb.ProcessingResponse, str]:
    """One request as Envoy sends it with a buffered body and no response body to the
    EPP (``engine`` accounting): the headers' answer and the routed request's key."""
    opening = headers(items)
    opening.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.BUFFERED
    opening.protocol_config.response_body_mode = processing_mode_pb2.ProcessingMode.NONE
    await stream.send(opening)
    (headers_answer,) = await stream.recv(1)
    await stream.send(body(payload))
    (answer,) = await stream.recv(1)
    return headers_answer, set_headers(answer, "request_body")["x-infergate-request-id"]


COMPLETION_POST = {
    ":method": "POST",
    ":path": "/v1/completions",
    "content-type": "application/json",
}


async def route_answered(epp: Epp, channel: grpc.aio.Channel) -> None:
    """One completion routed and answered 200 as an event stream, its stream closed: the
    request then waits for its engine's completion record (``awaiting``)."""
    stream = Stream(channel)
    await stream.send(headers(COMPLETION_POST), body(b'{"model":"m","prompt":"hi"}'))
    await stream.recv(2)
    await stream.send(response_headers({":status": "200", "content-type": "text/event-stream"}))
    await stream.recv(1)
    await stream.close()
    await eventually(lambda: len(epp.ext_proc.awaiting) == 1, timeout=10)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from infergate.engine.tiny_model import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("epp-tiny-llama"), arch="llama", seed=0))


async def eventually(
    check: Callable[[], bool], timeout: float = 20.0, interval: float = 0.05
) -> None:
    """Poll ``check`` until true (generous deadline: CI machines are shared)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


def reporting(endpoint: Endpoint) -> Endpoint:
    """``endpoint`` labelled as publishing completion records (on a port nothing binds)."""
    return Endpoint(endpoint.address, endpoint.port, ((COMPLETION_EVENTS_PORT_LABEL, "1"),))


#: What makes a request need its response headers (docs/epp.md, "Skipped response
#: headers"): one endpoint that sends no records, a plugin that adds response headers,
#: or the routing filter streaming response bodies to the EPP.
RESPONSE_NEEDS = ("one endpoint silent", "response-header plugin", "body sent")
PLUGIN_ADDS_HEADERS = """
kind: EndpointPickerConfig
plugins:
- type: session-affinity-scorer
- type: max-score-picker
"""


async def epp_needing_response(
    epp_factory: Callable[..., Awaitable[Epp]], case: str, tmp_path: Path, a: Endpoint, b: Endpoint
) -> tuple[Epp, int]:
    """An EPP over ``a`` and ``b`` whose requests need their response headers for
    ``case`` (one of :data:`RESPONSE_NEEDS`), and the response body mode Envoy announces."""
    endpoints = [reporting(a), b if case == "one endpoint silent" else reporting(b)]
    options: dict[str, object] = {"static_endpoints": endpoints}
    if case == "response-header plugin":
        config = tmp_path / "config.yaml"
        config.write_text(PLUGIN_ADDS_HEADERS)
        options["config_file"] = config
    mode = processing_mode_pb2.ProcessingMode
    body = mode.FULL_DUPLEX_STREAMED if case == "body sent" else mode.NONE
    return await epp_factory(**options), body
