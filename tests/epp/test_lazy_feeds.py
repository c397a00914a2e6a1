"""What a replica reads of the engines' feeds, and when (docs/epp.md, "Data layer").

Over real ZMQ, with PUB sockets this test owns standing in for engines: load reports and
other replicas' admission records wait, unread, until a decision reads them (the
datastore's refresh), which applies each engine's newest report only; a replica's
reader wakes for its own records, never for another replica's. The collector is
stopped, so nothing but a decision reads the feeds. Counted, never timed: messages
read, reports applied, reader wakeups.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc
from infergate.epp.app import Epp
from infergate.epp.datalayer import collector
from infergate.epp.datalayer.completions import COMPLETION_EVENTS_PORT_LABEL
from infergate.epp.types import Endpoint, EndpointState

from infergate.wire import load
from infergate.wire.completions import (
    ADMITTED,
    ADMITTED_TOPIC,
    CompletionBatch,
    CompletionRecord,
    owner,
    records_topic,
)
from infergate.wire.kv_events import encode_seq

from .conftest import EppFactory, Stream, body, eventually, headers, route_buffered, set_headers

POST = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}
#: Long enough for a message to cross loopback many times over: what an eager reader
#: would have read by then, a lazy one must still hold.
SETTLE_S = 1.0


def _report(waiting: int) -> bytes:
    return load.encode(
        load.LoadReport(
            sent_at=time.time(), tick=0.01, heartbeat=0.5, waiting=waiting, running=0,
            kv_usage=0.0, block_size=16, num_gpu_blocks=1024, max_lora=0,
            running_adapters=[], waiting_adapters=[], prefill_seconds_sum=0.0,
            prefill_count=0.0, prompt_tokens_total=0.0, prefix_hits_total=0.0,
            prefix_queries_total=0.0,
        )
    )  # fmt: skip


def _batch(*records: CompletionRecord) -> bytes:
    return msgspec.msgpack.encode(CompletionBatch(time.time(), list(records)))


class Engines:
    """PUB sockets standing in for engines' completion-events ports."""

    def __init__(self, count: int) -> None:
        self.context = zmq.Context()
        self.pubs: list[zmq.Socket[bytes]] = []
        self.endpoints: list[Endpoint] = []
        for i in range(count):
            pub = self.context.socket(zmq.PUB)
            port = pub.bind_to_random_port("tcp://127.0.0.1")
            self.pubs.append(pub)
            label = ((COMPLETION_EVENTS_PORT_LABEL, str(port)),)
            self.endpoints.append(Endpoint("127.0.0.1", 19101 + i, label))
        self.seq = iter(range(1 << 30))

    def send(self, engine: int, topic: bytes, payload: bytes) -> None:
        self.pubs[engine].send_multipart((topic, encode_seq(next(self.seq)), payload))

    def close(self) -> None:
        for pub in self.pubs:
            pub.close(0)
        self.context.term()


@pytest.fixture
def engines() -> Iterator[Any]:
    made: list[Engines] = []

    def make(count: int) -> Engines:
        made.append(Engines(count))
        return made[-1]

    yield make
    for fleet in made:
        fleet.close()


async def _reporting(
    epp: Epp, engines: Engines, engine: int, waiting: int, key: str = ""
) -> EndpointState:
    """Report ``waiting`` until the EPP has it (PUB drops until the SUB has joined)."""
    state = epp.datastore.get(key or engines.endpoints[engine].key)
    assert state is not None

    def seen() -> bool:
        engines.send(engine, load.TOPIC, _report(waiting))
        epp.datastore.refresh()
        return state.metrics.waiting == waiting and state.metrics.pushed

    await eventually(seen)
    return state


async def _watched(epp_factory: EppFactory, fleet: Engines) -> tuple[Engines, Epp, Any]:
    """An EPP whose two pushing endpoints both wait on its push watch."""
    epp = await epp_factory(static_endpoints=fleet.endpoints)
    await _reporting(epp, fleet, 0, 0)
    await _reporting(epp, fleet, 1, 0)
    watch = epp.collectors._pushes
    await eventually(lambda: watch.checks > 0)  # the endpoints wait on the watch now
    return fleet, epp, watch


async def _pick(epp: Epp, channel: Any) -> tuple[str, Stream]:
    stream = Stream(channel)
    payload = json.dumps({"model": "m", "prompt": "hi"}).encode()
    await stream.send(headers(POST), body(payload))
    answer, _ = await stream.recv(2)
    return set_headers(answer)["x-gateway-destination-endpoint"], stream


async def test_a_decision_reads_the_newest_reports_that_came_before_it_and_nothing_else_does(
    epp_factory: EppFactory, channel_for: Any, engines: Any
) -> None:
    fleet = engines(2)
    epp = await epp_factory(static_endpoints=fleet.endpoints)
    await epp.collectors.stop()  # only decisions read the feeds now
    first = await _reporting(epp, fleet, 0, 0)
    second = await _reporting(epp, fleet, 1, 50)
    # The first engine's queue fills and the second's empties, report by report.
    for waiting in range(1, 100):
        fleet.send(0, load.TOPIC, _report(waiting))
        fleet.send(1, load.TOPIC, _report(0))
    await asyncio.sleep(SETTLE_S)
    assert (first.metrics.waiting, second.metrics.waiting) == (0, 50)  # nothing woke for them
    applied, superseded = epp.load_reports.received, epp.completions.superseded

    picked, stream = await _pick(epp, channel_for(epp))
    assert picked == second.key  # the decision saw the reports sent just before it
    assert (first.metrics.waiting, second.metrics.waiting) == (99, 0)
    assert epp.load_reports.received - applied == 2  # one report per engine applied...
    assert epp.completions.superseded - superseded >= 2 * 98  # ...the rest not decoded
    await stream.close()


async def test_a_replica_wakes_for_its_own_records_and_reads_the_others_prefixes_at_a_decision(
    epp_factory: EppFactory, channel_for: Any, engines: Any, engine_metrics: Any
) -> None:
    fleet = engines(1)
    metrics = engine_metrics()  # a live engine running a request: only a record ends it
    metrics.set(0, 1, 0.0)
    endpoint = Endpoint("127.0.0.1", metrics.port, fleet.endpoints[0].labels)
    epp = await epp_factory(static_endpoints=[endpoint])
    await epp.collectors.stop()
    await _reporting(epp, fleet, 0, 0, endpoint.key)  # the feeds are connected
    stream = Stream(channel_for(epp))
    _, key = await route_buffered(stream, POST, b'{"model":"m","prompt":"hi"}')
    await stream.close()
    await eventually(lambda: key in epp.ext_proc.awaiting)
    assert owner(key) == epp.ext_proc.key_prefix

    # Another replica's traffic on this engine: its records, the prefixes it routed
    # (one of them this replica's own, echoed back), load reports.
    other = "0123456789abcdef"
    scorer = epp.plugin_context.extras["prefix_index"]
    packed = (7).to_bytes(8, "little") + (8).to_bytes(8, "little")
    woken = epp.completions.wakeups
    for n in range(50):
        done = CompletionRecord(f"{other}-{n:x}", 200, 5, 1, 0, 1.0)
        fleet.send(0, records_topic(other), _batch(done))
        fleet.send(0, load.TOPIC, _report(n % 3))
    theirs = CompletionRecord(f"{other}-ff", ADMITTED, 5, 0, 0, 1.0, packed)
    echoed = (9).to_bytes(8, "little") + (10).to_bytes(8, "little")
    mine = CompletionRecord(key, ADMITTED, 5, 0, 0, 1.0, echoed)
    fleet.send(0, ADMITTED_TOPIC, _batch(theirs, mine))
    await asyncio.sleep(SETTLE_S)
    assert epp.completions.wakeups == woken  # none of it woke this replica
    assert scorer.learned_blocks == 0  # nor was read yet

    epp.datastore.refresh()  # what a decision does first
    assert scorer.learned_blocks == 2  # the other replica's prefix; its own is known
    record = _batch(CompletionRecord(key, 200, 5, 1, 0, 2.0))

    def ended() -> bool:  # its own record ends it with no decision: a reader woke for it
        fleet.send(0, records_topic(owner(key)), record)  # (again, until the SUB has joined)
        return key not in epp.ext_proc.awaiting

    await eventually(ended)
    assert epp.completions.wakeups > woken


async def test_a_replica_that_decides_is_not_woken_by_the_push_watch(
    epp_factory: EppFactory, engines: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The liveness check of pushing endpoints rides on the decisions' refreshes when they
    come often enough; its timer wakes the replica only when none does."""
    # "Often enough": a refresh within PIGGYBACK_S (0.5 s) of the timer's deadline. This
    # test refreshes every 0.1 s, but under CI's load its own loop once stalled 0.4 s
    # between two refreshes and the timer fired first; a 1.5 s window keeps "often
    # enough" true of a loaded machine, and the assertions are the same.
    monkeypatch.setattr(collector, "PIGGYBACK_S", 1.5)
    fleet, epp, watch = await _watched(epp_factory, engines(2))
    checks, piggybacked = watch.checks, watch.piggybacked
    for _ in range(30):  # 3 s of heartbeats, a decision's refresh every 0.1 s
        for engine in range(2):
            fleet.send(engine, load.TOPIC, _report(0))
        epp.datastore.refresh()
        await asyncio.sleep(0.1)
    assert watch.checks - checks >= 2  # the pushes were checked...
    assert watch.checks - checks == watch.piggybacked - piggybacked  # ...by the decisions alone
    assert all(s.metrics.pushed for s in epp.datastore.all())


async def test_health_checks_do_the_push_watchs_check_in_place_of_its_timer(
    epp_factory: EppFactory, engines: Any, channel_for: Any
) -> None:
    """An EPP no request reaches is still health-checked by Envoy (a lone one every
    second): the push watch's check rides on those checks, and its timer does not wake it."""
    fleet, epp, watch = await _watched(epp_factory, engines(2))
    health = health_pb2_grpc.HealthStub(channel_for(epp))
    checks, piggybacked = watch.checks, watch.piggybacked
    # 3 s of heartbeats; a health check every 0.2 s (Envoy's come every 1 s: the watch's
    # window is 1 s wide, and a check 5 times in it keeps this true on a loaded machine).
    for _ in range(15):
        for engine in range(2):
            fleet.send(engine, load.TOPIC, _report(0))
        reply = await health.Check(health_pb2.HealthCheckRequest(service="liveness"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await asyncio.sleep(0.2)
    assert watch.checks - checks >= 2  # the pushes were checked...
    assert watch.checks - checks == watch.piggybacked - piggybacked  # ...by health checks alone
    assert all(s.metrics.pushed for s in epp.datastore.all())
