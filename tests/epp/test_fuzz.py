"""Property: no sequence of ext-proc messages crashes a stream or leaks accounting."""

from __future__ import annotations

import asyncio
import json

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from infergate.epp.app import Epp, EppOptions
from infergate.epp.server import StreamState
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
