"""The EPP's completion-record feed: what one received message costs, two ways.

A publisher thread sends ``--messages`` messages (vLLM's framing, a small payload),
``--gap-ms`` apart, over real ZMQ to a SUB socket on an asyncio loop in this process:

* ``asyncio``: ``await socket.recv_multipart()`` on pyzmq's asyncio socket (a future and
  a task step per message: the feed before 2026-12-02);
* ``reader``: a plain socket read from the loop's reader callback, drained with
  ``NOBLOCK`` (``CompletionSubscriptions._subscribe`` now).

Prints process CPU per message, the publisher thread's share included (the same in
both), so the difference between the lines is the receiving side's.

    .venv/bin/python benchmarks/epp_record_feed.py --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import zmq
import zmq.asyncio

from infergate.wire.kv_events import encode_seq

TOPIC = b"completions"
END = b"END"


def _publish(url: str, messages: int, gap_s: float) -> None:
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    socket.bind(url)
    time.sleep(0.5)  # the subscriber joins (PUB drops until then)
    for seq in range(messages):
        socket.send_multipart((TOPIC, encode_seq(seq), b"x" * 60))
        time.sleep(gap_s)
    socket.send_multipart((TOPIC, b"", END))
    time.sleep(0.2)
    socket.close(0)


async def _asyncio_feed(url: str) -> int:
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
    socket.connect(url)
    received = 0
    while (await socket.recv_multipart())[-1] != END:
        received += 1
    socket.close(0)
    context.term()
    return received


async def _reader_feed(url: str) -> int:
    context = zmq.Context()
    socket = zmq.Socket(context, zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
    socket.connect(url)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()
    received = 0

    def drain() -> None:
        nonlocal received
        while int(socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            if socket.recv_multipart(zmq.NOBLOCK)[-1] == END:
                if not done.done():
                    done.set_result(received)
                return
            received += 1

    descriptor = int(socket.getsockopt(zmq.FD))
    loop.add_reader(descriptor, drain)
    drain()
    try:
        return await done
    finally:
        loop.remove_reader(descriptor)
        socket.close(0)
        context.term()


def measure(mode: str, messages: int, gap_ms: float) -> float:
    """Process CPU (us) per message received in ``mode``."""
    with zmq.Context() as probe:  # a free port
        socket = probe.socket(zmq.PUB)
        port = socket.bind_to_random_port("tcp://127.0.0.1")
        socket.close(0)
    url = f"tcp://127.0.0.1:{port}"
    publisher = threading.Thread(target=_publish, args=(url, messages, gap_ms / 1000))
    publisher.start()
    started = time.process_time()
    feed = _asyncio_feed if mode == "asyncio" else _reader_feed
    received = asyncio.run(feed(url))
    publisher.join()
    if received != messages:
        raise SystemExit(f"{mode}: {received} of {messages} messages arrived")
    return (time.process_time() - started) * 1e6 / messages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--gap-ms", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for round_index in range(args.rounds):
        for mode in ("asyncio", "reader"):
            cost = measure(mode, args.messages, args.gap_ms)
            print(f"round {round_index + 1}  {mode:>8}  {cost:7.1f} us per message", flush=True)


if __name__ == "__main__":
    main()
