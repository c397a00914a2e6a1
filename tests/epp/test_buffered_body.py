"""Request bodies in ext_proc's BUFFERED mode (``--request-body-mode buffered``): the EPP
answers the headers at once, gets the whole body in one message, and routes on it with a
body answer that sets the headers and leaves the body alone unless routing rewrote it."""

from __future__ import annotations

import json

import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import json_format
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
    route_buffered,
    set_headers,
)

POST = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}
A = Endpoint("127.0.0.1", 18001)
B = Endpoint("127.0.0.1", 18002)
DESTINATION = "x-gateway-destination-endpoint"


def buffered_headers(items: dict[str, str], end_of_stream: bool = False) -> pb.ProcessingRequest:
    """The stream's first message, as Envoy sends it with ``request_body_mode: BUFFERED``."""
    message = headers(items, end_of_stream)
    message.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.BUFFERED
    return message


def _completion(model: str = "m", prompt: str = "hello") -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": 4}).encode()


@pytest.mark.parametrize("grpc_server", ["h2", "aio"])
async def test_the_pick_rides_on_the_body_answer_and_the_body_stays(
    epp_factory, channel_for, grpc_server: str
) -> None:
    epp = await epp_factory(static_endpoints=[A, B], grpc_server=grpc_server)
    stream = Stream(channel_for(epp))
    await stream.send(buffered_headers(POST))
    (headers_answer,) = await stream.recv(1)
    assert headers_answer.WhichOneof("response") == "request_headers"
    assert not headers_answer.request_headers.response.HasField("header_mutation")

    payload = _completion(prompt="x" * 300_000)
    await stream.send(body(payload))
    (answer,) = await stream.recv(1)
    common = answer.request_body.response
    destination = set_headers(answer, "request_body")[DESTINATION]
    assert destination in (A.key, B.key)
    assert common.clear_route_cache
    assert not common.HasField("body_mutation")  # Envoy forwards what it buffered
    dynamic = json_format.MessageToDict(answer.dynamic_metadata)
    # The ordered list rides in the metadata, its first entry in the header.
    assert dynamic["envoy.lb"][DESTINATION].split(",")[0] == destination
    await stream.close()


async def test_a_rewritten_body_replaces_the_buffered_one(epp_factory, channel_for) -> None:
    epp = await epp_factory(static_endpoints=[A])
    stream = Stream(channel_for(epp))
    await stream.send(
        buffered_headers({**POST, "x-gateway-model-name-rewrite": "forced"}),
    )
    await stream.recv(1)
    await stream.send(body(_completion(model="original")))
    (answer,) = await stream.recv(1)
    sent = answer.request_body.response.body_mutation.body
    assert json.loads(sent)["model"] == "forced"
    assert set_headers(answer, "request_body")["content-length"] == str(len(sent))


async def test_trailers_after_a_buffered_body_do_not_hold_the_pick(
    epp_factory, channel_for
) -> None:
    """Envoy waits for the body's answer before it sends trailers: the EPP routes on the
    body even though it does not end the stream."""
    epp = await epp_factory(static_endpoints=[A])
    stream = Stream(channel_for(epp))
    await stream.send(buffered_headers(POST))
    await stream.recv(1)
    await stream.send(body(_completion(), end_of_stream=False))
    (answer,) = await stream.recv(1)
    assert set_headers(answer, "request_body")[DESTINATION].startswith(A.key)
    await stream.send(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    (trailers,) = await stream.recv(1)
    assert trailers.WhichOneof("response") == "request_trailers"


async def test_bad_buffered_bodies_get_a_clear_error(epp_factory, channel_for) -> None:
    epp = await epp_factory(static_endpoints=[A], max_request_body_bytes=1000)
    channel = channel_for(epp)
    for payload, status, words in (
        (b"{not json", 400, "not valid JSON"),
        (b"x" * 1200, 413, "exceeds 1000 bytes"),
        (json.dumps({"model": 3, "prompt": "p"}).encode(), 400, "'model' must be a string"),
    ):
        stream = Stream(channel)
        await stream.send(buffered_headers(POST))
        await stream.recv(1)
        await stream.send(body(payload))
        (answer,) = await stream.recv(1)
        assert answer.immediate_response.status.code == status, payload[:20]
        assert words in json.loads(answer.immediate_response.body)["error"]["message"]


async def test_a_body_less_request_routes_on_its_headers(epp_factory, channel_for) -> None:
    epp = await epp_factory(static_endpoints=[A])
    stream = Stream(channel_for(epp))
    await stream.send(buffered_headers({":method": "GET", ":path": "/v1/models"}, True))
    (answer,) = await stream.recv(1)
    assert set_headers(answer)[DESTINATION].startswith(A.key)


@pytest.mark.parametrize("grpc_server", ["h2", "aio"])
async def test_a_body_envoy_is_still_buffering_times_out(
    epp_factory, channel_for, grpc_server: str
) -> None:
    """``--body-timeout`` runs from the headers' answer to the body's arrival: a client
    that never finishes its upload gets the EPP's 408 while Envoy is still buffering."""
    epp = await epp_factory(static_endpoints=[A], body_timeout_s=0.3, grpc_server=grpc_server)
    stream = Stream(channel_for(epp))
    await stream.send(buffered_headers(POST))
    await stream.recv(1)
    (answer,) = await stream.recv(1, timeout=5)
    assert answer.immediate_response.status.code == 408


async def test_response_headers_are_skipped_when_every_endpoint_reports(
    epp_factory, channel_for
) -> None:
    """Nothing needs them: the headers answer overrides the mode whole (the body still
    comes); when the stream ends the request waits for its record, and is over when the
    record arrives, with the record's status and tokens."""
    epp = await epp_factory(static_endpoints=[reporting(A), reporting(B)])
    stream = Stream(channel_for(epp))
    headers_answer, key = await route_buffered(stream, POST, _completion())
    mode = headers_answer.mode_override
    assert mode.response_header_mode == processing_mode_pb2.ProcessingMode.SKIP
    assert mode.request_body_mode == processing_mode_pb2.ProcessingMode.BUFFERED
    assert mode.response_body_mode == processing_mode_pb2.ProcessingMode.NONE
    await stream.close()
    await eventually(lambda: key in epp.ext_proc.awaiting, timeout=10)
    state = epp.ext_proc.awaiting[key]
    endpoint = state.endpoint_key
    assert epp.datastore.get(endpoint).in_flight_requests == 1  # counted until the record comes
    epp.ext_proc.on_record(endpoint, CompletionRecord(key, 200, 5, 7, 0, 1.0))
    assert key not in epp.ext_proc.awaiting and key not in epp.ext_proc.routed
    assert epp.datastore.get(endpoint).in_flight_requests == 0
    assert state.response.status == 200 and state.response.completion_tokens == 7


@pytest.mark.parametrize("case", RESPONSE_NEEDS)
async def test_response_headers_come_when_something_needs_them(
    epp_factory, channel_for, case: str, tmp_path
) -> None:
    epp, response_body = await epp_needing_response(epp_factory, case, tmp_path, A, B)
    stream = Stream(channel_for(epp))
    message = buffered_headers(POST)
    message.protocol_config.response_body_mode = response_body
    await stream.send(message)
    (headers_answer,) = await stream.recv(1)
    assert not headers_answer.HasField("mode_override")
    await stream.close()
