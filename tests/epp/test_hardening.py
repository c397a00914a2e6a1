"""Bad input and overload, through a real grpc.aio client: clear answers, nothing held.

Every malformed body is a 400 in OpenAI's error shape (never a 500 or a traceback), and
the EPP's own limits — bytes buffered across streams, concurrent streams, the body
deadline — answer at once (503/503/408) and release what the stream held.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from infergate.epp.types import Endpoint

from .conftest import Stream, body, headers, response_body, response_headers

POST = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}
A = Endpoint("127.0.0.1", 18001)

MALFORMED: dict[str, bytes] = {
    "deep nesting": b'{"model":"m","prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "integer over 4300 digits": b'{"model":"m","max_tokens":' + b"9" * 5000 + b"}",
    "integer over 64 bits": b'{"model":"m","prompt":[1,2,184467440737095516160]}',
    "float out of range": b'{"model":"m","prompt":"x","temperature":1e999}',
    "lone high surrogate": b'{"model":"m","prompt":"abc\\ud800"}',
    "lone low surrogate": b'{"model":"m","messages":[{"role":"user","content":"\\udc00x"}]}',
    "reversed surrogate pair": b'{"model":"m","prompt":"\\udc00\\ud800"}',
    "surrogate in raw UTF-8": b'{"model":"m","prompt":"\xed\xa0\x80"}',
    "invalid UTF-8": b'{"model":"m","prompt":"\xff\xfe"}',
    "NaN": b'{"model":"m","prompt":NaN}',
    "truncated": b'{"model":"m","prompt":"abc',
    "not an object": b"[1,2,3]",
    "empty": b" ",
    "integer content": b'{"model":"m","messages":[{"role":"user","content":42}]}',
    "object content": b'{"model":"m","messages":[{"role":"user","content":{"a":1}}]}',
    "non-string part text": b'{"model":"m","messages":[{"role":"user","content":[{"text":1}]}]}',
    "non-object part": b'{"model":"m","messages":[{"role":"user","content":["hi"]}]}',
    "model not a string": b'{"model":["m"],"prompt":"x"}',
    "stream not a bool": b'{"model":"m","prompt":"x","stream":"yes"}',
    "negative max_tokens": b'{"model":"m","prompt":"x","max_tokens":-1}',
}


@pytest.mark.parametrize("payload", MALFORMED.values(), ids=MALFORMED.keys())
async def test_malformed_body_is_400_in_openai_shape(
    payload: bytes, epp_factory, channel_for, caplog: pytest.LogCaptureFixture
) -> None:
    epp = await epp_factory(static_endpoints=[A])
    stream = Stream(channel_for(epp))
    with caplog.at_level(logging.INFO, logger="infergate.epp"):
        await stream.send(headers(POST), body(payload, end_of_stream=True))
        (response,) = await stream.recv(1)
    assert response.immediate_response.status.code == 400
    error = json.loads(response.immediate_response.body)["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert isinstance(error["message"], str) and len(error["message"]) < 400
    bad = [
        r
        for r in caplog.records
        if r.name.startswith(("infergate.epp.server", "infergate.epp.requestcontrol"))
        and (r.levelno >= logging.WARNING or r.exc_info)
    ]
    assert not bad
    assert [r for r in caplog.records if "rejected with 400" in r.getMessage()]
    await stream.close()
    assert epp.ext_proc.buffered_bytes == 0
    assert sum(s.in_flight_requests for s in epp.datastore.all()) == 0


async def test_buffered_bytes_across_streams_are_capped(epp_factory, channel_for) -> None:
    epp = await epp_factory(static_endpoints=[A], max_buffered_bytes=1000)
    first, second = Stream(channel_for(epp)), Stream(channel_for(epp))
    await first.send(headers(POST), body(b'{"model":"m","prompt":"' + b"x" * 700, False))
    await asyncio.sleep(0.1)
    assert epp.ext_proc.buffered_bytes > 700
    await second.send(headers(POST), body(b"y" * 400, False))
    (refused,) = await second.recv(1)
    assert refused.immediate_response.status.code == 503
    assert "buffering too many" in json.loads(refused.immediate_response.body)["error"]["message"]
    # The first stream is unaffected and, once routed, gives its bytes back.
    await first.send(body(b'"}', True))
    routed = await first.recv(2)
    assert routed[0].request_headers.response.header_mutation.set_headers
    await first.close()
    await asyncio.sleep(0.05)
    assert epp.ext_proc.buffered_bytes == 0


async def test_concurrent_streams_are_capped(epp_factory, channel_for) -> None:
    epp = await epp_factory(static_endpoints=[A], max_streams=1)
    first = Stream(channel_for(epp))  # a Stream's RPC starts when it is made
    await first.send(headers(POST))
    for _ in range(100):  # the first stream is being served before the second opens
        if epp.ext_proc.active_streams == 1:
            break
        await asyncio.sleep(0.05)
    second = Stream(channel_for(epp))
    await second.send(headers(POST))
    (refused,) = await second.recv(1)
    assert refused.immediate_response.status.code == 503
    await first.close()
    await asyncio.sleep(0.1)
    assert epp.ext_proc.active_streams == 0


async def test_trickling_body_gets_408_and_is_released(epp_factory, channel_for) -> None:
    epp = await epp_factory(static_endpoints=[A], body_timeout_s=0.3)
    stream = Stream(channel_for(epp))
    await stream.send(headers(POST), body(b'{"model":"m","prompt":"', False))
    (response,) = await stream.recv(1, timeout=5)
    assert response.immediate_response.status.code == 408
    assert json.loads(response.immediate_response.body)["error"]["code"] == 408
    await asyncio.sleep(0.05)
    assert epp.ext_proc.buffered_bytes == 0
    assert epp.ext_proc.active_streams == 0


async def test_observer_stream_reads_usage_and_the_request_finishes_once(
    epp_factory, channel_for
) -> None:
    """The routing stream ends at the response headers (as Envoy does with no response
    body to send); the observer's stream carries usage; finish runs once, at the end."""
    epp = await epp_factory(static_endpoints=[A])
    routing = Stream(channel_for(epp))
    await routing.send(headers(POST), body(b'{"model":"m","prompt":"hi","stream":true}'))
    header_response, _ = await routing.recv(2)
    key = {
        h.header.key: h.header.raw_value.decode()
        for h in header_response.request_headers.response.header_mutation.set_headers
    }["x-infergate-request-id"]
    observer = Stream(channel_for(epp))
    seen = headers({**POST, "x-infergate-request-id": key})
    seen.observability_mode = True
    await observer.send(seen)
    # Envoy's observer sees the request before the upstream answers; the two gRPC streams
    # are independent here, so wait for the observer to attach before the response.
    for _ in range(100):
        routed = epp.ext_proc.routed.get(key)
        if routed is not None and routed.observer_attached:
            break
        await asyncio.sleep(0.01)
    await routing.send(response_headers({":status": "200", "content-type": "text/event-stream"}))
    await routing.recv(1)
    await routing.close()
    await asyncio.sleep(0.1)
    assert A.key in {s.key for s in epp.datastore.all()}
    assert sum(s.in_flight_requests for s in epp.datastore.all()) == 1  # not over yet
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":9}}\n\n'
    for message in (
        response_headers({":status": "200", "content-type": "text/event-stream"}),
        response_body(b'data: {"choices":[{"text":"x"}]}\n\n', False),
        response_body(usage + b"data: [DONE]\n\n", True),
    ):
        message.observability_mode = True
        await observer.send(message)
    await observer.close()
    await asyncio.sleep(0.2)
    assert sum(s.in_flight_requests for s in epp.datastore.all()) == 0
    assert epp.metrics.tokens.labels("completion")._value.get() == 9
    assert not epp.ext_proc.routed
