"""The EPP's memory under a flood of large bodies (issue 45 item 7).

Behind Envoy, the bytes of a body outlive its budget reservation twice: the echoed
body waits in the native HTTP/2 layer until Envoy's windows take it (they open only as
fast as Envoy's upstream reads), and the routed request keeps its parsed prompt until it
is over. Both are charged to ``--max-buffered-bytes`` now; here a peer whose windows stay
shut shows it, with a budget of four bodies and a half. Then, the burst over, the freed
memory is given back (``malloc_trim``), counted in ``ExtProcServer.trims``.
"""

from __future__ import annotations

import asyncio
import json
from functools import partial

import h2.settings
import pytest
from infergate.epp.types import Endpoint

from infergate.wire.names import MAX_REQUEST_BODY_BYTES

from .conftest import body, eventually, headers, set_headers
from .test_transport import POST, RawClient, _grpc

A = Endpoint("127.0.0.1", 18001)
BODY = json.dumps({"model": "m", "prompt": "z" * (512 << 10)}).encode()
BUDGET = 4 * len(BODY) + len(BODY) // 2
STREAMS = 8


def _requests(epp, outcome: str) -> float:
    return epp.metrics.requests.labels(outcome)._value.get()


def _handled(epp, streams: int) -> bool:
    return _requests(epp, "routed") + _requests(epp, "overloaded_503") == streams


def _native_held(epp) -> int:
    """What the connections' native layers hold (partial messages, queued answers)."""
    return sum(conn.native.buffered() for conn in epp._h2.connections)


async def test_answers_queued_for_a_shut_window_count_against_the_body_budget(
    epp_factory,
) -> None:
    epp = await epp_factory(static_endpoints=[A], grpc_server="h2", max_buffered_bytes=BUDGET)
    server = epp.ext_proc
    client = await RawClient.connect(epp.grpc_port)
    client.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    client.writer.write(client.h2.data_to_send())
    request = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
        (b":authority", b"epp"),
        (b"content-type", b"application/grpc"),
    ]
    peak = 0
    try:
        for index in range(STREAMS):  # one at a time: each fully handled before the next
            stream_id = 2 * index + 1
            client.h2.send_headers(stream_id, request)
            client.h2.send_data(stream_id, _grpc(headers(POST), body(BODY)))
            client.writer.write(client.h2.data_to_send())
            await eventually(partial(_handled, epp, index + 1))
            peak = max(peak, server.buffered_bytes + _native_held(epp))
        # Each routed body is held twice (its request in flight, its echo queued): two
        # fit in the budget; every later one is refused with the budget's 503 (without
        # the echo charged, four were routed; without either, all eight).
        assert _requests(epp, "routed") == 2
        assert _requests(epp, "overloaded_503") == STREAMS - 2
        assert server.buffered_bytes + server.transport_bytes <= BUDGET
        assert peak <= BUDGET
        assert server.transport_bytes >= 2 * len(BODY)  # the queued echoes, charged
        assert server.trims == 0  # the burst is not over
    finally:
        client.close()
    # The peer gone: its queued answers and its requests are released, the burst is over
    # and its memory given back.
    await eventually(lambda: server.active_streams == 0 and server.transport_bytes == 0)
    await eventually(lambda: server.trims == 1)
    assert server.buffered_bytes == 0


async def _pump(client: RawClient) -> bool:
    """Read what the EPP sent (answers, window updates); True once stream 1 has ended."""
    import h2.events

    data = await asyncio.wait_for(client.reader.read(1 << 20), 10)
    assert data, "the EPP closed the connection"
    ended = False
    for event in client.h2.receive_data(data):
        if isinstance(event, h2.events.TrailersReceived):
            client.headers.update(dict(event.headers))
        elif isinstance(event, h2.events.DataReceived):
            client.data += event.data
            client.h2.acknowledge_received_data(event.flow_controlled_length, 1)
        elif isinstance(event, h2.events.StreamEnded):
            ended = True
    client.writer.write(client.h2.data_to_send())
    return ended


async def _upload(client: RawClient, payload: bytes, chunk: int = 512 << 10) -> bool:
    """``payload`` as ext-proc body messages on stream 1, as far as the windows allow;
    True if the EPP ended the stream before all of it was sent."""
    client.call(_grpc(headers(POST)), end_stream=False)
    for at in range(0, len(payload), chunk):
        last = at + chunk >= len(payload)
        frame = _grpc(body(payload[at : at + chunk], last))
        while client.h2.local_flow_control_window(1) < len(frame):
            if await _pump(client):
                return True
        client.h2.send_data(1, frame)
        client.writer.write(client.h2.data_to_send())
        await client.writer.drain()
    return False


@pytest.mark.parametrize("mib", [24, 64])
async def test_a_body_larger_than_the_windows_is_served_or_refused(epp_factory, mib) -> None:
    """Bodies past the 16 MiB windows never stall: 24 MiB under a 32 MiB cap is routed
    and echoed whole; 64 MiB under the default 8 MiB cap gets 413 (the rest is dropped
    as it comes)."""
    cap = 32 << 20 if mib == 24 else MAX_REQUEST_BODY_BYTES
    epp = await epp_factory(static_endpoints=[A], grpc_server="h2", max_request_body_bytes=cap)
    payload = json.dumps({"model": "m", "prompt": "w" * ((mib << 20) - 32)}).encode()
    client = await RawClient.connect(epp.grpc_port)
    try:
        cut_short = await _upload(client, payload)
        if mib == 64:
            while not client.responses():  # most likely here already
                await _pump(client)
            (answer,) = client.responses()
            assert answer.immediate_response.status.code == 413  # then Envoy ends the stream
        else:
            assert not cut_short
            while len(client.data) < len(payload):
                await _pump(client)
            header_response, *echoed = client.responses()
            assert set_headers(header_response)["x-gateway-destination-endpoint"] == A.key
            streamed = [e.request_body.response.body_mutation.streamed_response for e in echoed]
            assert b"".join(s.body for s in streamed) == payload
    finally:
        client.close()
    await eventually(lambda: epp.ext_proc.buffered_bytes == 0)
