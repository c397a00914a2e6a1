"""The lazily read engine feed over plain TCP (``datalayer/zmtp.py``), against libzmq PUB
sockets as the engines bind them: what it receives, that it runs no thread of its own and
leaves unread messages in the kernel until asked, and how it dials and redials."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest
import zmq
from infergate.epp.datalayer.zmtp import (
    COMMAND,
    GREETING,
    LONG,
    MORE,
    FrameParser,
    ZmtpError,
    ZmtpFeed,
)

from infergate.procs import free_port

from .conftest import eventually

TOPICS = (b"load", b"admitted")


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    made = zmq.Context()
    yield made
    made.destroy(linger=0)


def _publisher(context: zmq.Context[zmq.Socket[bytes]], port: int) -> zmq.Socket[bytes]:
    socket = context.socket(zmq.PUB)
    socket.bind(f"tcp://127.0.0.1:{port}")
    return socket


async def _joined(publisher: zmq.Socket[bytes], feed: ZmtpFeed) -> None:
    """Publish a marker until the feed reads it (PUB drops until the subscription is in)."""
    seen: list[list[bytes]] = []

    def arrived() -> bool:
        publisher.send_multipart([b"load", b"marker"])
        seen.extend(feed.read())
        return any(m == [b"load", b"marker"] for m in seen)

    await eventually(arrived)
    await asyncio.sleep(0.2)  # markers still in flight
    feed.read()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


async def test_the_feed_reads_its_topics_whole_and_in_order_and_nothing_else(context) -> None:
    port = free_port()
    publisher = _publisher(context, port)
    feed = ZmtpFeed("127.0.0.1", port, TOPICS, 1 << 20)
    feed.start()
    try:
        await _joined(publisher, feed)
        large = os.urandom(70_000)  # a long frame (8-byte size)
        publisher.send_multipart([b"load", b"1", b"first"])
        publisher.send_multipart([b"other", b"2", b"not subscribed"])
        publisher.send_multipart([b"admitted", b"3", large])
        publisher.send_multipart([b"load", b"4", b"last"])
        got: list[list[bytes]] = []

        def three() -> bool:
            got.extend(feed.read())
            return len(got) >= 3

        await eventually(three)
        assert got == [
            [b"load", b"1", b"first"],
            [b"admitted", b"3", large],
            [b"load", b"4", b"last"],
        ]
    finally:
        feed.close()


async def test_messages_wait_in_the_kernel_until_read_and_no_thread_receives_them(context) -> None:
    port = free_port()
    publisher = _publisher(context, port)
    threads = _threads()
    feed = ZmtpFeed("127.0.0.1", port, TOPICS, 1 << 20)
    feed.start()
    try:
        await _joined(publisher, feed)
        read = feed.read_count
        for n in range(200):
            publisher.send_multipart([b"load", b"%d" % n, b"x" * 200])
        await asyncio.sleep(0.5)  # long enough for loopback many times over
        assert feed.read_count == read  # nothing took them meanwhile...
        assert _threads() == threads  # ...and no thread of the feed's exists to do so
        got = feed.read()
        assert [m[1] for m in got] == [b"%d" % n for n in range(200)]
    finally:
        feed.close()


async def test_an_oversized_frame_drops_the_connection_and_the_feed_redials(context) -> None:
    port = free_port()
    publisher = _publisher(context, port)
    feed = ZmtpFeed("127.0.0.1", port, TOPICS, 4096)
    feed.start()
    try:
        await _joined(publisher, feed)
        publisher.send_multipart([b"load", b"1", b"y" * 5000])
        await eventually(lambda: not feed.read() and feed.drops == 1)
        await _joined(publisher, feed)  # dialled again: reports arrive again
        assert feed.connects == 2
    finally:
        feed.close()


async def test_the_feed_dials_until_the_engine_is_up_and_again_after_it_restarts(context) -> None:
    port = free_port()
    feed = ZmtpFeed("127.0.0.1", port, TOPICS, 1 << 20)
    feed.start()  # nothing listens yet: it keeps trying
    try:
        await asyncio.sleep(0.3)
        assert not feed.connected and feed.read() == []
        publisher = _publisher(context, port)
        await _joined(publisher, feed)
        publisher.close(linger=0)  # the engine restarts on the same port
        await eventually(lambda: not feed.read() and not feed.connected)  # seen at a read
        publisher = _publisher(context, port)
        await _joined(publisher, feed)
        assert feed.connects == 2
    finally:
        feed.close()


def _frame(body: bytes, flags: int = 0) -> bytes:
    if len(body) > 255:
        return bytes([flags | LONG]) + len(body).to_bytes(8, "big") + body
    return bytes([flags, len(body)]) + body


def test_a_stream_parses_the_same_whole_or_byte_by_byte() -> None:
    large = os.urandom(1000)
    stream = (
        GREETING
        + _frame(b"\x05READY", COMMAND)
        + _frame(b"load", MORE)
        + _frame(b"\x00" * 8, MORE)
        + _frame(b"report")
        + _frame(b"\x04PING", COMMAND)
        + _frame(b"admitted", MORE)
        + _frame(large)
    )
    expected = [[b"load", b"\x00" * 8, b"report"], [b"admitted", large]]
    assert FrameParser(4096).feed(stream) == expected
    parser = FrameParser(4096)
    got: list[list[bytes]] = []
    for i in range(len(stream)):
        got += parser.feed(stream[i : i + 1])
    assert got == expected and parser.commands == 2
    with pytest.raises(ZmtpError):
        FrameParser(512).feed(stream)  # the 1,000-byte frame is over this parser's limit
    with pytest.raises(ZmtpError):
        FrameParser(4096).feed(b"HTTP/1.1 200 OK\r\n" + bytes(64))  # not a ZMTP peer
