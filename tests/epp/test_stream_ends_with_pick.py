"""Streamed bodies (GIE's FULL_DUPLEX_STREAMED) when nothing needs the response headers:
the EPP ends the ext-proc stream with OK right after the pick's answer, so Envoy sends it
no response headers (Envoy ignores ``mode_override`` in that mode, so ending the stream is
the one way to skip them). The request stays counted until its completion record."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from infergate.epp.types import Endpoint

from infergate.wire.completions import CompletionRecord

from .conftest import (
    RESPONSE_NEEDS,
    Stream,
    body,
    epp_needing_response,
    eventually,
    headers,
    reporting,
    response_headers,
    set_headers,
)

POST = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}
PAYLOAD = b'{"model":"m","prompt":"hello","max_tokens":4}'
A = Endpoint("127.0.0.1", 18001)
B = Endpoint("127.0.0.1", 18002)
MODE = processing_mode_pb2.ProcessingMode


def _streamed_headers(response_body: int = MODE.NONE) -> pb.ProcessingRequest:
    """The stream's first message as our bootstrap's routing filter sends it."""
    message = headers(POST)
    message.protocol_config.request_body_mode = MODE.FULL_DUPLEX_STREAMED
    message.protocol_config.response_body_mode = response_body
    return message


async def _routed(stream: Stream) -> str:
    """Headers and the whole body in one go, as Envoy streams them: the routed key."""
    await stream.send(_streamed_headers(), body(PAYLOAD))
    headers_answer, body_answer = await stream.recv(2)
    assert body_answer.request_body.response.body_mutation.streamed_response.body == PAYLOAD
    return set_headers(headers_answer)["x-infergate-request-id"]


@pytest.mark.parametrize("grpc_server", ["h2", "aio"])
async def test_the_stream_ends_with_the_pick_when_every_endpoint_reports(
    epp_factory, channel_for, grpc_server: str
) -> None:
    epp = await epp_factory(static_endpoints=[reporting(A), reporting(B)], grpc_server=grpc_server)
    stream = Stream(channel_for(epp))
    key = await _routed(stream)
    # Nothing more comes: OK trailers right after the pick (Envoy then forwards the
    # response without consulting the EPP).
    assert await asyncio.wait_for(stream.call.read(), 10) is grpc.aio.EOF
    assert await stream.call.code() == grpc.StatusCode.OK
    # Counted until its record arrives, then released with the record's figures.
    await eventually(lambda: key in epp.ext_proc.awaiting, timeout=10)
    state = epp.ext_proc.awaiting[key]
    endpoint = state.endpoint_key
    assert epp.datastore.get(endpoint).in_flight_requests == 1
    epp.ext_proc.on_record(endpoint, CompletionRecord(key, 200, 5, 7, 0, 1.0))
    assert key not in epp.ext_proc.awaiting and key not in epp.ext_proc.routed
    assert epp.datastore.get(endpoint).in_flight_requests == 0
    assert state.response.status == 200 and state.response.completion_tokens == 7


@pytest.mark.parametrize("case", RESPONSE_NEEDS)
async def test_the_stream_stays_open_when_something_needs_the_response(
    epp_factory, channel_for, case: str, tmp_path
) -> None:
    epp, response_body = await epp_needing_response(epp_factory, case, tmp_path, A, B)
    stream = Stream(channel_for(epp))
    await stream.send(_streamed_headers(response_body), body(PAYLOAD))
    await stream.recv(2)
    await stream.send(response_headers({":status": "200", "content-type": "application/json"}))
    (answer,) = await stream.recv(1)  # the stream is still open: the headers are answered
    assert answer.WhichOneof("response") == "response_headers"
    await stream.close()
