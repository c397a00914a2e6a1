"""Property: no sequence of ext-proc messages crashes a stream or leaks accounting."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import random

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from infergate.epp.app import Epp, EppOptions
from infergate.epp.server.stream import StreamState
from infergate.epp.types import Endpoint

HEADER_NAMES = [
    ":method",
    ":path",
    "content-type",
    "x-gateway-inference-objective",
    "test-epp-endpoint-selection",
    "x-session-token",
]
BODIES = st.one_of(
    st.binary(max_size=200),
    st.builds(
        lambda m, p, s, t: json.dumps(
            {"model": m, "prompt": p, "stream": s, "max_tokens": t}
        ).encode(),
        st.text(max_size=10),
        st.one_of(st.text(max_size=300), st.lists(st.integers(0, 1000), max_size=50)),
        st.booleans(),
        st.integers(-5, 100),
    ),
    st.just(b'{"messages": [{"role": "user", "content": "hi"}]}'),
)


def _headers(kind: str, items: list[tuple[str, str]], eos: bool) -> pb.ProcessingRequest:
    hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in items]
    http = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv), end_of_stream=eos)
    return pb.ProcessingRequest(**{kind: http})


MESSAGES = st.one_of(
    st.builds(
        _headers,
        st.sampled_from(["request_headers", "response_headers"]),
        st.lists(st.tuples(st.sampled_from(HEADER_NAMES), st.text(max_size=30)), max_size=4),
        st.booleans(),
    ),
    st.builds(
        lambda b, e: pb.ProcessingRequest(request_body=pb.HttpBody(body=b, end_of_stream=e)),
        BODIES,
        st.booleans(),
    ),
    st.builds(
        lambda b, e: pb.ProcessingRequest(response_body=pb.HttpBody(body=b, end_of_stream=e)),
        BODIES,
        st.booleans(),
    ),
    st.just(pb.ProcessingRequest(request_trailers=pb.HttpTrailers())),
    st.just(pb.ProcessingRequest(response_trailers=pb.HttpTrailers())),
    st.just(pb.ProcessingRequest()),
)

EPP = Epp(
    EppOptions(
        static_endpoints=[Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)],
        max_request_body_bytes=400,
    )
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(MESSAGES, max_size=8))
def test_any_message_sequence_is_handled(messages: list[pb.ProcessingRequest]) -> None:
    async def drive() -> None:
        state = StreamState(EPP.ext_proc)
        for message in messages:
            responses = await state.handle(message)
            assert all(isinstance(r, pb.ProcessingResponse) for r in responses)
        state.close()

    asyncio.run(drive())
    assert all(s.in_flight_requests == 0 for s in EPP.datastore.all())


# --- 10,000 malformed request streams -------------------------------------------------

_VALID = [
    {"model": "m", "prompt": "hello world", "max_tokens": 8, "stream": True},
    {"model": "m", "messages": [{"role": "user", "content": "hi there"}]},
    {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]},
    {"model": "m", "prompt": [1, 2, 3]},
]
_POISON: list[bytes] = [
    b"[" * 3000 + b"]" * 3000,
    b"9" * 5000,
    b"1e999",
    b"184467440737095516160",
    b'"\\ud800"',
    b'"abc\\udfff"',
    b'"\\udc00\\ud800"',
    b'"\xed\xa0\x80"',
    b'"\xff"',
    b"NaN",
    b"-Infinity",
    b"{}",
    b"[]",
    b"42",
    b"null",
    b"true",
    b'{"text": 5}',
    b'[{"text": ["x"]}]',
    b'["plain string part"]',
]
_FIELDS = ["model", "prompt", "messages", "stream", "max_tokens", "cache_salt", "input"]


def _malformed(rng: random.Random) -> bytes:
    """One body that is wrong in one of the ways clients get it wrong (or attack it)."""
    base = json.dumps(rng.choice(_VALID)).encode()
    kind = rng.randrange(6)
    if kind == 0:  # a field's value replaced by poison
        field = rng.choice(_FIELDS)
        return b'{"model":"m","%s":%s}' % (field.encode(), rng.choice(_POISON))
    if kind == 1:  # poison as a message's content
        return b'{"model":"m","messages":[{"role":"user","content":%s}]}' % rng.choice(_POISON)
    if kind == 2:  # truncated
        return base[: rng.randrange(len(base))]
    if kind == 3:  # random bytes flipped
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if kind == 4:  # poison as the whole body
        return rng.choice(_POISON)
    return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))


def _stream(rng: random.Random, payload: bytes) -> list[pb.ProcessingRequest]:
    post = [(":method", "POST"), (":path", "/v1/completions")]
    messages = [_headers("request_headers", post, False)]
    count = max(0, min(len(payload) - 1, rng.randint(0, 3)))
    cuts = sorted(rng.sample(range(1, len(payload)), count)) if count else []
    pieces = [payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)], strict=True)]
    for i, piece in enumerate(pieces):
        messages.append(
            pb.ProcessingRequest(
                request_body=pb.HttpBody(body=piece, end_of_stream=i == len(pieces) - 1)
            )
        )
    return messages


def test_ten_thousand_malformed_streams_give_no_500_and_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Seeded, so a failure replays: every stream is answered 400 or routed, never 500."""
    epp = Epp(EppOptions(static_endpoints=[Endpoint("10.0.0.1", 8000)]))
    rng = random.Random(17)
    statuses: collections.Counter[int] = collections.Counter()

    async def drive() -> None:
        for _ in range(10_000):
            state = StreamState(epp.ext_proc)
            for message in _stream(rng, _malformed(rng)):
                for response in await state.handle(message):
                    if response.HasField("immediate_response"):
                        statuses[response.immediate_response.status.code] += 1
                    elif response.HasField("request_headers"):
                        statuses[200] += 1
            state.close()

    with caplog.at_level(logging.WARNING, logger="infergate.epp"):
        asyncio.run(drive())
    assert sum(statuses.values()) == 10_000
    assert set(statuses) <= {200, 400}, statuses
    assert statuses[400] > 8_000, statuses
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert epp.ext_proc.buffered_bytes == 0
    assert all(s.in_flight_requests == 0 for s in epp.datastore.all())
