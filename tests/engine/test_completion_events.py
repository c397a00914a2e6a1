"""Completion records: one per EPP-routed request, over a real ZMQ PUB/SUB, with usage.

The middleware wraps a small ASGI app that runs "engine requests" the way the servers
do (the async engine adds each finished one to the current ``Usage``); a real SUB socket
decodes what the publisher sends.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
import zmq
from infergate.engine.completion_events import (
    CURRENT,
    CompletionPublisher,
    CompletionReporter,
    Usage,
)
from infergate.engine.kv_events import bind_endpoint

from infergate.procs import free_port
from infergate.wire import load
from infergate.wire.completions import (
    ADMITTED,
    ADMITTED_TOPIC,
    TOPIC,
    CompletionRecord,
    decode_batch,
    decode_prefix,
    encode_prefix,
    owner,
    prefix_hashes,
    records_topic,
)
from infergate.wire.names import PREFIX_HEADER


def test_n_choices_of_one_prompt_count_the_prompt_once() -> None:
    usage = Usage()
    prompt, other = object(), object()
    usage.add(id(prompt), 10, 4, 8)
    usage.add(id(prompt), 10, 6, 8)  # second choice of the same prompt
    usage.add(id(other), 3, 1, 0)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (13, 11, 8)


def test_the_first_submission_alone_calls_back_with_its_prompt_tokens() -> None:
    calls: list[int] = []
    usage = Usage(calls.append)
    usage.submitted(12)  # n choices or a batch: the first engine request announces it
    usage.submitted(30)
    assert calls == [12]
    Usage().submitted(5)  # no callback: nothing to do, no error


async def _app(scope: Any, receive: Any, send: Any) -> None:
    usage = CURRENT.get()
    assert usage is not None or scope["path"] == "/unrouted"
    if scope["path"] == "/refused":  # rejected before any engine request (a 400)
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})
        return
    if usage is not None:
        usage.submitted(7)  # as AsyncEngine.generate does with the tokenized prompt
        usage.add(1, 7, 3, 5)
    if scope["path"] == "/fail":
        raise RuntimeError("handler failed")
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"a", "more_body": True})
    await send({"type": "http.response.body", "body": b"b", "more_body": False})


@pytest.fixture
def channel() -> Any:
    port = free_port()
    publisher = CompletionPublisher(f"tcp://*:{port}")  # a wildcard binds
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(f"tcp://127.0.0.1:{port}")
    yield publisher, sub
    sub.close(0)
    context.term()
    publisher.close()


def _records(sub: Any, count: int) -> list[CompletionRecord]:
    out: list[CompletionRecord] = []
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while len(out) < count and poller.poll(5000):
        topic, _seq, payload = sub.recv_multipart()
        batch = decode_batch(payload).records
        assert {records_topic(owner(r.key)) for r in batch} == {topic}  # its replica's topic
        out.extend(batch)
    return out


def test_one_record_per_routed_request_with_its_usage_and_status(channel: Any) -> None:
    publisher, sub = channel
    app = CompletionReporter(_app, publisher)

    async def run() -> None:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            await asyncio.sleep(0.3)  # the SUB connects (PUB drops what nobody receives)
            assert (await client.get("/unrouted")).status_code == 200
            ok = await client.get("/ok", headers={"x-infergate-request-id": "k1"})
            assert ok.text == "ab"
            await client.get("/fail", headers={"x-infergate-request-id": "k2"})
            await client.get("/refused", headers={"x-infergate-request-id": "k3"})

    asyncio.run(run())
    every = _records(sub, 5)
    records = {r.key: r for r in every if r.status != ADMITTED}
    assert set(records) == {"k1", "k2", "k3"}  # none for the request the EPP did not route
    k1 = records["k1"]
    assert (k1.status, k1.prompt_tokens, k1.completion_tokens, k1.cached_tokens) == (200, 7, 3, 5)
    assert k1.finished_at > 0
    assert records["k2"].status == 499  # the response never reached the client
    assert records["k3"].status == 400
    # The prompts the engine took were announced, with their tokens, before they ended;
    # the refused request never reached the engine and has no admission record.
    admitted = [(r.key, r.prompt_tokens, r.prefix) for r in every if r.status == ADMITTED]
    assert admitted == [("k1", 7, b""), ("k2", 7, b"")]
    assert every.index(next(r for r in every if r.key == "k1")) < every.index(k1)


def test_an_admission_record_echoes_the_prefix_header_and_bad_ones_are_dropped(
    channel: Any,
) -> None:
    publisher, sub = channel
    app = CompletionReporter(_app, publisher)
    hashes = [1, 2, 2**64 - 1]

    async def run() -> None:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            await asyncio.sleep(0.3)  # the SUB connects (PUB drops what nobody receives)
            routed = {"x-infergate-request-id": "k1", PREFIX_HEADER: encode_prefix(hashes)}
            assert (await client.get("/ok", headers=routed)).status_code == 200
            for key, bad in (("k2", "not base64!"), ("k3", "QUJD"), ("k4", "A" * 5000)):
                headers = {"x-infergate-request-id": key, PREFIX_HEADER: bad}
                assert (await client.get("/ok", headers=headers)).status_code == 200
            # Without the EPP's key no record at all, whatever the prefix header says.
            await client.get("/unrouted", headers={PREFIX_HEADER: encode_prefix(hashes)})

    asyncio.run(run())
    records = _records(sub, 8)
    admitted = [r for r in records if r.status == ADMITTED]
    assert [(r.key, r.prompt_tokens, prefix_hashes(r.prefix)) for r in admitted] == [
        ("k1", 7, hashes),
        *((k, 7, []) for k in ("k2", "k3", "k4")),
    ]
    done = sorted((r.key, r.status, r.prefix) for r in records if r.status != ADMITTED)
    assert done == [(k, 200, b"") for k in ("k1", "k2", "k3", "k4")]


def test_each_replica_is_sent_its_own_records_and_every_replica_the_prefixes() -> None:
    """One engine, requests of two EPP replicas: a subscriber to one replica's topic gets
    that replica's records alone, and the admission records with prefix hashes go out
    once more, on the topic every replica reads."""
    port = free_port()
    publisher = CompletionPublisher(bind_endpoint("127.0.0.1", port))
    context = zmq.Context()
    mine, shared = context.socket(zmq.SUB), context.socket(zmq.SUB)
    try:
        mine.setsockopt(zmq.SUBSCRIBE, records_topic("aaaa"))
        shared.setsockopt(zmq.SUBSCRIBE, ADMITTED_TOPIC)
        for sub in (mine, shared):
            sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)  # PUB drops what is sent before the SUB joins
        packed = decode_prefix(encode_prefix([7, 8]))
        for key in ("aaaa-1", "bbbb-1", "aaaa-2"):
            publisher.publish(CompletionRecord(key, ADMITTED, 5, 0, 0, 1.0, packed))
            publisher.publish(CompletionRecord(key, 200, 5, 1, 0, 2.0))
        got = _records(mine, 4)
        assert sorted((r.key, r.status) for r in got) == [
            ("aaaa-1", 0), ("aaaa-1", 200), ("aaaa-2", 0), ("aaaa-2", 200)
        ]  # fmt: skip
        assert not mine.poll(300)  # nothing of replica bbbb's
        assert shared.poll(5000)
        topic, _seq, payload = shared.recv_multipart()
        assert topic == ADMITTED_TOPIC
        keys = [r.key for r in decode_batch(payload).records]
        while shared.poll(300):
            keys += [r.key for r in decode_batch(shared.recv_multipart()[2]).records]
        assert sorted(keys) == ["aaaa-1", "aaaa-2", "bbbb-1"]  # admissions only, each once
    finally:
        mine.close(0)
        shared.close(0)
        context.term()
        publisher.close()


def _load_report() -> load.LoadReport:
    return load.LoadReport(
        sent_at=time.time(), tick=0.01, heartbeat=0.5, waiting=1, running=0, kv_usage=0.0,
        block_size=16, num_gpu_blocks=64, max_lora=0, running_adapters=[],
        waiting_adapters=[], prefill_seconds_sum=0.0, prefill_count=0.0,
        prompt_tokens_total=0.0, prefix_hits_total=0.0, prefix_queries_total=0.0,
    )  # fmt: skip


def test_prefixes_for_every_replica_go_out_in_order_not_held_for_a_load_report() -> None:
    """An admission record's prefixes reach the other replicas ahead of the load report
    the engine queued after it: replicas read both lazily, at a decision, so nothing is
    gained by holding the prefixes for a report to travel with, and a replica deciding
    meanwhile would not know where the prefix went."""
    port = free_port()
    publisher = CompletionPublisher(bind_endpoint("127.0.0.1", port))
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        for topic in (ADMITTED_TOPIC, load.TOPIC):
            sub.setsockopt(zmq.SUBSCRIBE, topic)
        sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)  # PUB drops what is sent before the SUB joins
        packed = decode_prefix(encode_prefix([7, 8]))
        for n in range(1500):  # keep the publisher's thread busy: what follows queues up
            publisher.publish(CompletionRecord(f"bbbb-{n:x}", 200, 5, 1, 0, 1.0))
        publisher.publish(CompletionRecord("aaaa-1", ADMITTED, 5, 0, 0, 1.0, packed))
        publisher.publish_load(_load_report())
        assert sub.poll(5000)
        assert [sub.recv_multipart()[0] for _ in range(2)] == [ADMITTED_TOPIC, load.TOPIC]
    finally:
        sub.close(0)
        context.term()
        publisher.close()


@pytest.mark.parametrize(
    ("host", "endpoint"),
    [
        ("127.0.0.1", "tcp://127.0.0.1:5600"),
        ("10.1.2.3", "tcp://10.1.2.3:5600"),
        ("0.0.0.0", "tcp://*:5600"),
        ("", "tcp://*:5600"),
        ("::", "tcp://[::]:5600"),
        ("::1", "tcp://[::1]:5600"),
        ("[::1]", "tcp://[::1]:5600"),
    ],
)
def test_publishers_bind_the_engines_host(host: str, endpoint: str) -> None:
    assert bind_endpoint(host, 5600) == endpoint


def test_a_concrete_address_is_bound_not_connected() -> None:
    """vLLM's rule would connect a PUB to a concrete address; completion records are
    always served (bound) by the engine, on its own host."""
    port = free_port()
    publisher = CompletionPublisher(bind_endpoint("127.0.0.1", port))
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)  # PUB drops what is sent before the SUB joins
        record = CompletionRecord("k", 200, 1, 2, 0, 1.0)
        publisher.publish(record)
        assert _records(sub, 1) == [record]
    finally:
        sub.close(0)
        context.term()
        publisher.close()
