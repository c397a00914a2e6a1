"""KV events from a running engine, received by a ZMQ SUB and decoded as vLLM's format."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from infergate.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

from infergate.procs import ProcessGroup, free_port, http_ready
from infergate.wire.block_hash import block_hashes

from .conftest import API_KEY, MODEL, Server

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
def subscriber(sim_server: Server) -> Iterator[zmq.Socket[bytes]]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.connect(f"tcp://127.0.0.1:{sim_server.kv_events_port}")
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)  # PUB/SUB: let the subscription reach the publisher first
    yield sock
    sock.close(linger=0)


def receive(sock: zmq.Socket[bytes], until: type, timeout: float = 10.0) -> list[object]:
    """Decode batches until an event of type ``until`` arrives; check the framing."""
    events: list[object] = []
    deadline = time.monotonic() + timeout
    last_seq = -1
    while time.monotonic() < deadline:
        if not sock.poll(200):
            continue
        topic, seq, payload = sock.recv_multipart()
        assert topic == b""
        number = int.from_bytes(seq, "big")
        assert number > last_seq
        last_seq = number
        raw = msgspec.msgpack.decode(payload)
        assert isinstance(raw, list) and isinstance(raw[0], float) and raw[2] == 0
        batch = decode_batch(payload)
        events += batch.events
        if any(isinstance(e, until) for e in batch.events):
            return events
    raise AssertionError(f"no {until.__name__} within {timeout}s; got {events}")


def complete(server: Server, prompt: str, **extra: object) -> dict[str, object]:
    res = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert res.status_code == 200, res.text
    return dict(res.json())


def test_block_stored_hashes_match_the_shared_recipe(
    sim_server: Server, subscriber: zmq.Socket[bytes]
) -> None:
    prompt = "Once upon a time there was a small town by the sea. " * 3
    ids = httpx.post(f"{sim_server.url}/tokenize", headers=AUTH, json={"prompt": prompt}).json()[
        "tokens"
    ]
    complete(sim_server, prompt, cache_salt="kv-events-test")
    stored = [e for e in receive(subscriber, BlockStored) if isinstance(e, BlockStored)]
    hashes = [h for e in stored for h in e.block_hashes]
    expected = block_hashes(ids, 16, cache_salt="kv-events-test")
    assert hashes[: len(expected)] == expected  # the EPP can predict them from the prompt
    first = stored[0]
    assert first.parent_block_hash is None and first.block_size == 16
    assert first.token_ids[: len(expected) * 16] == ids[: len(expected) * 16]
    assert first.medium == "GPU"
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(first))
    assert raw[0] == "BlockStored" and len(raw) == 8  # tagged array, vLLM's field order


def test_evictions_and_reset_are_published(
    sim_server: Server, subscriber: zmq.Socket[bytes]
) -> None:
    sim_server.wait_idle()
    # 128 blocks of 16 tokens: distinct ~600-token prompts soon reuse cached blocks.
    for i in range(5):
        complete(sim_server, f"{i} " + "A scheduler decides which requests run. " * 40)
    events = receive(subscriber, BlockRemoved)
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed
    sim_server.wait_idle()
    with sim_server.http() as http:
        res = http.post("/reset_prefix_cache")
    assert res.status_code == 200
    receive(subscriber, AllBlocksCleared)


def test_vllm_kv_events_config_connects_to_a_bound_subscriber(
    processes: ProcessGroup, infergate_cli: list[str], tiny_model_dir: Path
) -> None:
    """llm-d's layout: the router binds SUB, engines connect their PUB with a topic."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub_port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
    port = free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{sub_port}",
        "topic": f"kv@127.0.0.1@{MODEL}",
    }
    try:
        processes.start(
            "engine-kv-connect",
            [*infergate_cli, "engine", "serve", str(tiny_model_dir), "--simulate",
             "--port", str(port), "--served-model-name", MODEL,
             "--kv-events-config", json.dumps(config)],
            ready=http_ready(f"http://127.0.0.1:{port}/health"),
            timeout=120,
        )  # fmt: skip
        # A bound SUB handles the engine's connection (and sends its subscription) only
        # when the application calls into it: poll while the connection settles.
        sock.poll(500)
        res = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 2},
            timeout=60,
        )
        assert res.status_code == 200
        assert sock.poll(10_000), "no KV events arrived"
        topic, seq, payload = sock.recv_multipart()
        assert topic == f"kv@127.0.0.1@{MODEL}".encode() and int.from_bytes(seq, "big") == 0
        assert any(isinstance(e, BlockStored) for e in decode_batch(payload).events)
    finally:
        sock.close(linger=0)


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the process listens on."""
    import psutil

    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_event_publishers_listen_on_the_engines_host(
    processes: ProcessGroup, infergate_cli: list[str], tiny_model_dir: Path, host: str
) -> None:
    """--completion-events-port and --kv-events-port bind where the HTTP server does:
    loopback stays loopback; only a wildcard --host listens on every interface. The
    completion records still reach a subscriber on loopback."""
    from infergate.wire.completions import TOPIC

    port, kv_port, records_port = free_port(), free_port(), free_port()
    engine = processes.start(
        f"engine-host-{host}",
        [*infergate_cli, "engine", "serve", str(tiny_model_dir), "--simulate",
         "--host", host, "--port", str(port), "--served-model-name", MODEL,
         "--kv-events-port", str(kv_port), "--completion-events-port", str(records_port)],
        ready=http_ready(f"http://127.0.0.1:{port}/health"),
        timeout=120,
    )  # fmt: skip
    listening = _listening(engine.pid)
    for p in (port, kv_port, records_port):
        assert (host, p) in listening, (host, p, listening)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    try:
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sock.connect(f"tcp://127.0.0.1:{records_port}")
        time.sleep(0.3)  # PUB drops what is sent before the SUB joins
        res = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            headers={"x-infergate-request-id": "r-1"},
            json={"model": MODEL, "prompt": "hello there", "max_tokens": 2},
            timeout=60,
        )
        assert res.status_code == 200
        assert sock.poll(10_000), "no completion record arrived"
    finally:
        sock.close(0)
