"""The engine's KV events replay socket (vLLM's ``replay_endpoint``), over real ZMQ clients.

A replay returns the batches exactly as they were published, from the asked sequence
number on, then the end marker; malformed requests, impossible sequence numbers, junk
bytes and clients that vanish mid-reply leave the engine serving (and replaying).
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from infergate.procs import ManagedProcess, ProcessGroup, free_port, http_ready
from infergate.wire.kv_events import END_OF_REPLAY, decode_batch, encode_seq

from .conftest import MODEL

Frames = list[bytes]


class Engine:
    def __init__(self, process: ManagedProcess, port: int, kv_port: int, replay_port: int):
        self.process, self.port, self.kv_port, self.replay_port = (
            process, port, kv_port, replay_port,
        )  # fmt: skip

    def complete(self, prompt: str) -> None:
        res = httpx.post(
            f"http://127.0.0.1:{self.port}/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
            timeout=60,
        )
        assert res.status_code == 200, res.text

    def healthy(self) -> bool:
        return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, infergate_cli: list[str]) -> Iterator[Engine]:
    """--kv-events-port for the stream, --kv-events-config's replay_endpoint (vLLM's way)."""
    port, kv_port, replay_port = free_port(), free_port(), free_port()
    config = {"replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "buffer_steps": 1000}
    with ProcessGroup() as group:
        process = group.start(
            "engine-replay",
            [*infergate_cli, "engine", "serve", str(tiny_model_dir), "--simulate",
             "--port", str(port), "--served-model-name", MODEL,
             "--kv-events-port", str(kv_port), "--kv-events-config", json.dumps(config)],
            ready=http_ready(f"http://127.0.0.1:{port}/health"),
            timeout=120,
        )  # fmt: skip
        yield Engine(process, port, kv_port, replay_port)


def live_batches(engine: Engine, tag: str, prompts: int) -> list[tuple[int, bytes]]:
    """(seq, payload) of every live message while ``prompts`` new requests run."""
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{engine.kv_port}")
    time.sleep(0.3)  # PUB drops what is sent before the SUB joins
    try:
        for i in range(prompts):
            engine.complete(f"{tag} {i} replay me, block by block. " * 8)
        got = []
        while sub.poll(1000):
            _, seq, payload = sub.recv_multipart()
            got.append((int.from_bytes(seq, "big"), payload))
        return got
    finally:
        sub.close(0)


def ask(
    engine: Engine, *request: bytes, kind: int = zmq.DEALER, timeout_ms: int = 3000
) -> list[Frames]:
    """Send one replay request; every reply message up to the end marker ([] if none came)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(kind)
    sock.connect(f"tcp://127.0.0.1:{engine.replay_port}")
    try:
        sock.send_multipart(list(request))
        replies: list[Frames] = []
        while sock.poll(timeout_ms):
            frames = sock.recv_multipart()
            replies.append(frames)
            if END_OF_REPLAY in frames or kind == zmq.REQ:
                break
        return replies
    finally:
        sock.close(0)


def test_replay_returns_the_published_batches_then_the_end_marker(engine: Engine) -> None:
    live = live_batches(engine, "published", 3)
    assert len(live) >= 3 and [s for s, _ in live] == list(range(live[0][0], live[-1][0] + 1))
    start = live[1][0]

    replies = ask(engine, b"", encode_seq(start))  # a DEALER, with the REQ delimiter
    assert replies[-1] == [b"", END_OF_REPLAY, b""]
    replayed = [(int.from_bytes(seq, "big"), payload) for _, seq, payload in replies[:-1]]
    assert replayed[: len(live) - 1] == live[1:]  # byte for byte, in order
    assert all(decode_batch(payload).events for _, payload in replayed)

    # vLLM's own client is a REQ socket: its first reply is the first asked-for batch.
    (first,) = ask(engine, encode_seq(start), kind=zmq.REQ)
    assert first == [encode_seq(start), live[1][1]]
    # A DEALER without the delimiter gets replies without one.
    bare = ask(engine, encode_seq(live[-1][0]))
    assert bare[0] == [encode_seq(live[-1][0]), live[-1][1]] and bare[-1] == [END_OF_REPLAY, b""]


@pytest.mark.parametrize(
    "request_frames",
    [
        [b"", b"garbage"],  # not 8 bytes
        [b"", encode_seq(0), b"extra frame"],
        [b""],  # the delimiter alone
        [b"", b""],
        [b"", (-1).to_bytes(8, "big", signed=True)],  # "negative": 2**64 - 1 unsigned
        [b"", (2**63).to_bytes(8, "big")],
        [b"", b"\xff" * 7, b"\x00" * 3],
    ],
    ids=["short-seq", "extra-frame", "delimiter-only", "empty-seq", "minus-one", "huge", "junk"],
)
def test_a_request_it_cannot_serve_gets_the_end_marker_alone(
    engine: Engine, request_frames: Frames
) -> None:
    assert ask(engine, *request_frames) == [[b"", END_OF_REPLAY, b""]]
    assert engine.healthy()


def test_hostile_clients_leave_replay_and_serving_up(engine: Engine) -> None:
    live = live_batches(engine, "hostile", 2)
    assert live
    assert ask(engine, b"", b"bad") == [[b"", END_OF_REPLAY, b""]]
    # An oversized request: ZMQ drops the connection (MAXMSGSIZE), no reply.
    assert ask(engine, b"", b"x" * 100_000, timeout_ms=1000) == []
    # Raw bytes that are not ZMTP at all.
    with socket.create_connection(("127.0.0.1", engine.replay_port), timeout=5) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 64)
    # Clients that ask for everything and vanish without reading.
    for _ in range(20):
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{engine.replay_port}")
        sock.send_multipart([b"", encode_seq(0)])
        sock.close(linger=200)  # the request leaves; the reply finds nobody
    time.sleep(0.5)

    assert engine.process.alive() and engine.healthy()
    engine.complete("still serving after all that")
    replies = ask(engine, b"", encode_seq(live[0][0]))
    assert replies[-1] == [b"", END_OF_REPLAY, b""]
    assert [(int.from_bytes(s, "big"), p) for _, s, p in replies[: len(live)]] == live
    assert "malformed request" in engine.process.log_tail(200_000)


def test_bad_replay_settings_are_one_clear_line(
    infergate_cli: list[str], tiny_model_dir: Path
) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        cases = [
            (["--kv-events-config", '{"buffer_steps": 0}'], "buffer_steps must be at least 1"),
            (["--kv-events-replay-port", str(busy.getsockname()[1])], "cannot open KV events"),
        ]
        for extra, expect in cases:
            result = subprocess.run(
                [*infergate_cli, "engine", "serve", str(tiny_model_dir), "--simulate",
                 "--port", str(free_port()), "--kv-events-port", str(free_port()), *extra],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert result.returncode == 2, result.stderr
            lines = [line for line in result.stderr.splitlines() if "error" in line]
            assert len(lines) == 1 and expect in lines[0], result.stderr
            assert "Traceback" not in result.stderr
    finally:
        busy.close()
