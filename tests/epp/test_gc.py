"""Requests leave no reference cycle in the EPP, and a started EPP freezes its heap.

Why it matters: garbage in cycles is only freed by the collector, whose collections then
run every few requests and, as survivors pile up, grow into full collections that pause
the loop (and every request in flight) for tens of milliseconds.
"""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Iterator

import pytest
from infergate.epp.heap import freeze_heap
from infergate.epp.server import h2
from infergate.epp.server.stream import StreamState
from infergate.epp.types import Endpoint

from .conftest import Stream, body, headers, response_headers, set_headers

POST = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}
A = Endpoint("127.0.0.1", 18001)
OURS = (h2.Stream, h2.ExtProcCall, StreamState)


@pytest.fixture
def saved_garbage() -> Iterator[list[object]]:
    """``gc.garbage`` with every unreachable object the collector finds kept in it."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


async def _one_request(stream: Stream, payload: bytes) -> None:
    await stream.send(headers(POST), body(payload))
    header_response, _ = await stream.recv(2)
    assert set_headers(header_response)["x-gateway-destination-endpoint"] == A.key
    await stream.send(response_headers({":status": "200"}, end_of_stream=True))
    await stream.recv(1)
    await stream.close()


async def test_routed_requests_leave_no_cyclic_garbage(
    epp_factory, channel_for, saved_garbage
) -> None:
    epp = await epp_factory(static_endpoints=[A], grpc_server="h2")
    channel = channel_for(epp)
    payload = json.dumps({"model": "m", "prompt": "hello " * 100, "max_tokens": 1}).encode()
    for _ in range(20):
        await _one_request(Stream(channel), payload)
    for _ in range(100):  # the EPP sees each stream's end a moment after the client
        if epp.ext_proc.active_streams == 0:
            break
        await asyncio.sleep(0.02)
    assert epp.ext_proc.active_streams == 0
    gc.collect()
    left = [type(o).__name__ for o in saved_garbage if isinstance(o, OURS)]
    assert left == []


def test_freezing_the_heap_keeps_collecting_what_comes_later() -> None:
    class Node:
        def __init__(self) -> None:
            self.me = self

    try:
        freeze_heap()
        assert gc.get_freeze_count() > 1000  # this test process's modules, at least
        Node()  # a cycle made after the freeze
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()
