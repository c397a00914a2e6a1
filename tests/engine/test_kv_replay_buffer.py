"""The replay buffer's edges, on a real publisher and ROUTER in this process: a request
before the oldest kept batch starts at the oldest, one past the newest gets the end
marker alone, and the buffer keeps exactly ``buffer_steps`` batches."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq
from infergate.engine.kv_events import BlockRemoved, ZmqEventPublisher

from infergate.procs import free_port
from infergate.wire.kv_events import END_OF_REPLAY, decode_batch, encode_seq


@pytest.fixture
def replay_port() -> Iterator[int]:
    port = free_port()
    publisher = ZmqEventPublisher(
        f"tcp://127.0.0.1:{free_port()}", bind=True,
        replay_endpoint=f"tcp://127.0.0.1:{port}", buffer_steps=3,
    )  # fmt: skip
    for i in range(5):  # seq 0-4; 2, 3 and 4 stay buffered
        publisher.publish([BlockRemoved([i], "GPU")])
    deadline = time.monotonic() + 10
    while replay(port, 4) != [4]:  # the publishing thread has sent the last one
        assert time.monotonic() < deadline, "seq 4 was never buffered"
        time.sleep(0.01)
    yield port
    publisher.close()


def replay(port: int, start: int) -> list[int]:
    """The seqs a replay from ``start`` returns (each batch checked against its seq)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send_multipart([b"", encode_seq(start)])
        seqs: list[int] = []
        while True:
            assert sock.poll(5000), "no end marker"
            _, seq, payload = sock.recv_multipart()
            if seq == END_OF_REPLAY:
                assert payload == b""
                return seqs
            number = int.from_bytes(seq, "big")
            (event,) = decode_batch(payload).events
            assert isinstance(event, BlockRemoved) and event.block_hashes == [number]
            seqs.append(number)
    finally:
        sock.close(0)


@pytest.mark.parametrize(
    ("start", "expect"),
    [(0, [2, 3, 4]), (2, [2, 3, 4]), (3, [3, 4]), (4, [4]), (5, []), (2**64 - 1, [])],
)
def test_replay_edges(replay_port: int, start: int, expect: list[int]) -> None:
    assert replay(replay_port, start) == expect
