"""The completion-record feed over real ZMQ: one PUB socket stands in for an engine's
publisher (vLLM's framing: topic, sequence number, msgpack batch). Garbage, a frame
over the EPP's size limit and records of requests it never routed cost nothing; the
record of a routed request still ends it, with the record's status and tokens."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import zmq
from infergate.epp.datalayer.completions import COMPLETION_EVENTS_PORT_LABEL, MAX_FRAME
from infergate.epp.types import Endpoint

from infergate.wire.completions import CompletionBatch, CompletionRecord, owner, records_topic
from infergate.wire.kv_events import encode_seq

from .conftest import Stream, eventually, route_buffered

POST = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}


def _batch(*records: CompletionRecord) -> bytes:
    return msgspec.msgpack.encode(CompletionBatch(time.time(), list(records)))


async def test_garbage_on_the_feed_is_dropped_and_records_still_end_requests(
    epp_factory, channel_for, engine_metrics, caplog
) -> None:
    caplog.set_level(logging.WARNING, logger="infergate.epp.datalayer.completions")
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    try:
        # A live endpoint running one request, so neither the dead-endpoint rule (a port
        # that refuses) nor the engine's counts give the awaited record up: only the feed.
        metrics = engine_metrics()
        metrics.set(0, 1, 0.0)
        endpoint = Endpoint("127.0.0.1", metrics.port, ((COMPLETION_EVENTS_PORT_LABEL, str(port)),))
        epp = await epp_factory(static_endpoints=[endpoint])
        stream = Stream(channel_for(epp))
        _, key = await route_buffered(stream, POST, b'{"model":"m","prompt":"hi"}')
        await stream.close()  # its response headers skipped: it waits for its record
        await eventually(lambda: key in epp.ext_proc.awaiting, timeout=10)
        seq = iter(range(1, 1 << 30))

        def send(payload: bytes) -> None:  # on the topic of the routing replica's records
            publisher.send_multipart((records_topic(owner(key)), encode_seq(next(seq)), payload))

        garbage = [b"", b"\xff" * 10, msgspec.msgpack.encode({"records": 1}), b"[1, 2"]
        stranger = _batch(CompletionRecord("not-routed-here", 200, 1, 1, 0, 1.0))
        # PUB drops until the SUB has joined: repeat until the EPP has seen garbage.
        deadline = time.monotonic() + 10
        while "bad completion batch" not in caplog.text:
            assert time.monotonic() < deadline, "the EPP never received the feed"
            for payload in garbage:
                send(payload)
            send(stranger)
            await asyncio.sleep(0.05)
        assert key in epp.ext_proc.awaiting  # nothing of that touched the routed request
        send(b"\x00" * (MAX_FRAME + 1))  # over the limit: ZMQ drops the peer, then redials
        deadline = time.monotonic() + 10
        while key in epp.ext_proc.awaiting:
            assert time.monotonic() < deadline, "the record never ended the request"
            send(_batch(CompletionRecord(key, 200, 5, 7, 2, time.time())))
            await asyncio.sleep(0.05)
        state = epp.datastore.get(endpoint.key)
        assert state is not None and state.in_flight_requests == 0
        assert key not in epp.ext_proc.routed
    finally:
        publisher.close(0)
        context.term()
