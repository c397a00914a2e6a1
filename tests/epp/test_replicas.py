"""Active-active EPP replicas: what one replica learns from the others' routing.

Unit level (the e2e proof through real engines and Envoy is tests/e2e/test_epp_replicas.py):
the prefix-hash header round trip and its bounds, the prefix index learning from an
admission record (and ignoring bad ones), the load estimate that counts other replicas'
requests through the engine's report, and the flow controller's shared budget.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import msgspec
import pytest
from infergate.epp.config import DEFAULT_CONFIG_YAML
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.flowcontrol.config import FlowControlConfig
from infergate.epp.flowcontrol.controller import FlowController
from infergate.epp.flowcontrol.metrics import FlowControlMetrics
from infergate.epp.flowcontrol.saturation import SaturationDetector
from infergate.epp.prefill_cost import PrefillCost
from infergate.epp.scheduling.plugins.base import PluginContext, SchedulingResult
from infergate.epp.scheduling.plugins.prefix import PrefixCacheScorer
from infergate.epp.types import CycleState, Endpoint, EndpointState, InferenceRequest, Metrics
from prometheus_client import CollectorRegistry

from infergate.wire.completions import (
    ADMITTED,
    MAX_PREFIX_HASHES,
    CompletionBatch,
    CompletionRecord,
    decode_batch,
    decode_prefix,
    encode_prefix,
    prefix_hashes,
)
from infergate.wire.names import ORDER_DELAY_HEADER, PREFIX_HEADER

from .conftest import Stream, body, headers


def test_prefix_header_round_trips_and_is_bounded() -> None:
    hashes = [0, 1, 2**64 - 1, 1234567890123] * 100
    value = encode_prefix(hashes)
    assert prefix_hashes(decode_prefix(value)) == hashes[:MAX_PREFIX_HASHES]
    assert prefix_hashes(decode_prefix(value.encode())) == hashes[:MAX_PREFIX_HASHES]


@pytest.mark.parametrize(
    "value",
    [b"", b"!!!!", b"abc", b"A" * 5, "é" * 12, b"A" * 100_000, b"\x00\xff" * 8, "AAAAAAAAAAA="],
)
def test_malformed_prefix_headers_decode_to_nothing(value: bytes | str) -> None:
    packed = decode_prefix(value)
    assert len(packed) % 8 == 0 and len(packed) <= 8 * MAX_PREFIX_HASHES
    assert prefix_hashes(b"x" * 7) == [] and prefix_hashes(b"x" * 8 * 1000) == []


def test_admission_record_round_trips_and_old_records_still_decode() -> None:
    admitted = CompletionRecord("k", ADMITTED, 0, 0, 0, 1.0, b"\x01" * 16)
    batch = decode_batch(msgspec.msgpack.encode(CompletionBatch(1.0, [admitted])))
    assert batch.records[0].prefix == b"\x01" * 16
    six = msgspec.msgpack.encode([1.0, [["k", 200, 3, 4, 1, 2.0]]])
    assert decode_batch(six).records[0].prefix == b""


def _scorer(*keys: tuple[str, int]) -> tuple[PrefixCacheScorer, Datastore]:
    datastore = Datastore()
    datastore.set_endpoints([Endpoint(host, port) for host, port in keys])
    params = PrefixCacheScorer.Params.model_validate({"lruCapacityPerServer": 64})
    scorer = PrefixCacheScorer(
        "prefix", params, PluginContext(datastore, SaturationDetector(5, 0.8, 2.0))
    )
    return scorer, datastore


async def _route(scorer: PrefixCacheScorer, datastore: Datastore, prompt: str) -> CycleState:
    request = InferenceRequest("r", {}, body={"prompt": prompt}, model="m", prompt_text=prompt)
    cycle = CycleState()
    await scorer.prepare(cycle, request, datastore.all())
    return cycle


async def test_a_replica_learns_what_another_routed() -> None:
    routing, ds_a = _scorer(("10.0.0.1", 8000), ("10.0.0.2", 8000))
    other, ds_b = _scorer(("10.0.0.1", 8000), ("10.0.0.2", 8000))
    prompt = "a shared system prompt " * 40
    cycle = await _route(routing, ds_a, prompt)
    result = SchedulingResult("default", [ds_a.get("10.0.0.2:8000")])  # type: ignore[list-item]
    request = InferenceRequest("r", {}, model="m", prompt_text=prompt)
    routing.pre_request(cycle, request, result)
    header = result.request_headers[PREFIX_HEADER]
    # The other replica has never seen the prompt: nothing cached anywhere.
    assert (await _route(other, ds_b, prompt))["prefix.matches"] == {}
    # The engine echoes the header's hashes in its admission record.
    assert other.learn("10.0.0.2:8000", decode_prefix(header)) == cycle["prefix.blocks"]
    matches = (await _route(other, ds_b, prompt))["prefix.matches"]
    assert matches == {"10.0.0.2:8000": cycle["prefix.blocks"]}


async def test_bad_or_foreign_admission_records_add_nothing_and_floods_stay_bounded() -> None:
    scorer, _ = _scorer(("10.0.0.1", 8000))
    assert scorer.learn("10.0.0.9:8000", b"\x01" * 16) == 0  # not a known endpoint
    assert scorer.learn("10.0.0.1:8000", b"\x01" * 15) == 0  # not whole hashes
    assert scorer.learn("10.0.0.1:8000", b"\x01" * 8 * (MAX_PREFIX_HASHES + 1)) == 0
    assert scorer.index.size("10.0.0.1:8000") == 0
    for i in range(2_000):  # a flood of distinct prefixes: the LRU holds its capacity
        packed = decode_prefix(encode_prefix([i * 1000 + j for j in range(8)]))
        assert scorer.learn("10.0.0.1:8000", packed) == 8
    assert scorer.index.size("10.0.0.1:8000") == 64


async def test_a_full_index_forgets_a_groups_tail_not_its_head() -> None:
    """An engine frees a request's blocks tail first, so when its cache is full it keeps
    a group's shared head. The index must forget in that order: a replica whose index for
    the holder overflowed (its own routing plus another replica's admission record) still
    matches the group there. Added head first, the overflow dropped the head and, with
    it, every match of the group: the next request went to an engine without it
    (docs/benchmarks/scale.md, "Replicas")."""
    scorer, datastore = _scorer(("10.0.0.1", 8000), ("10.0.0.2", 8000))
    holder = datastore.get("10.0.0.2:8000")
    assert holder is not None
    prompts = [f"group {g}: ".ljust(24 * 64, "x") for g in "abc"]  # 24 blocks each
    first = await _route(scorer, datastore, prompts[0])
    request = InferenceRequest("r", {}, model="m", prompt_text=prompts[0])
    scorer.pre_request(first, request, SchedulingResult("default", [holder]))
    learned = await _route(scorer, datastore, prompts[1])
    assert learned["prefix.blocks"] == 24
    scorer.learn(holder.key, learned["prefix.hashes"])
    third = await _route(scorer, datastore, prompts[2])
    scorer.pre_request(third, request, SchedulingResult("default", [holder]))
    assert scorer.index.size(holder.key) == 64  # 72 blocks routed there: 8 forgotten
    again = await _route(scorer, datastore, prompts[0])
    assert again["prefix.matches"] == {holder.key: 24 - 8}
    assert scorer.score(again, request, datastore.all()) == [0.0, 16 / 24]


def test_every_replica_learns_an_engines_prefill_cost_as_one_replica_does() -> None:
    """Each replica sees the responses (cached tokens) of only its own requests, about
    1/N of an engine's. Reading a window's hit fraction from those alone, one or two
    responses stood for the window, and identical engines' per-token costs spread 5x
    across replicas, so cold groups were placed by that noise. The requests a replica
    did not see count at the engine's own hit ratio."""
    rng = random.Random(0)
    alone, replicas = PrefillCost(), [PrefillCost() for _ in range(4)]
    seen = [[0, 0] for _ in replicas]
    engine = [0.0] * 4  # prefill seconds, requests, prompt tokens, cached tokens
    for cost in (alone, *replicas):
        cost.observe_counters(0, 0, 0, 0, 0, now=0.0)
    for window in range(1, 21):
        for _ in range(rng.randint(4, 12)):  # tight-prefix: 2,500-token groups, 1 in 5 cold
            prompt, cached = 2532, 0 if rng.random() < 0.2 else 2496
            who = seen[rng.randrange(len(seen))]
            who[0], who[1] = who[0] + prompt, who[1] + cached
            engine = [engine[0] + 0.005 + 40e-6 * (prompt - cached), engine[1] + 1,
                      engine[2] + prompt, engine[3] + cached]  # fmt: skip
        s, n, p, hits = engine
        alone.observe_counters(s, n, p, hits, p, now=2.0 * window, observed=(int(p), int(hits)))
        for cost, (sp, sc) in zip(replicas, seen, strict=True):
            cost.observe_counters(s, n, p, hits, p, now=2.0 * window, observed=(sp, sc))
    assert alone.per_token == pytest.approx(40e-6, rel=0.1)
    for cost in replicas:
        assert cost.per_token == pytest.approx(alone.per_token, rel=0.1)


def _state(running: int, waiting: int) -> EndpointState:
    metrics = Metrics(running=running, waiting=waiting, updated_at=time.monotonic())
    return EndpointState(Endpoint("10.0.0.1", 8000), metrics)


def test_load_counts_other_replicas_through_the_report_and_own_picks_since() -> None:
    state = _state(running=6, waiting=2)  # 8 requests, most sent by other replicas
    assert state.load() == 8
    state.note_pick()
    state.note_pick()
    assert state.in_flight_requests == 2 and state.load() == 10
    state.note_done()
    assert state.load() == 9
    # The next report already counts the pick still running: no double count.
    state.metrics = Metrics(running=7, waiting=2, updated_at=time.monotonic() + 1)
    assert state.load() == 9


def test_single_replica_load_is_its_own_in_flight() -> None:
    state = EndpointState(Endpoint("10.0.0.1", 8000))  # no report yet
    for _ in range(3):
        state.note_pick()
    assert state.load() == 3
    state.metrics = Metrics(running=3, waiting=0, updated_at=time.monotonic())
    assert state.load() == 3  # the report and the picks agree
    state.note_done()
    assert state.load() == 2  # a finish counts at once, not at the next report


async def test_flow_control_budget_is_shared_through_engine_reports() -> None:
    datastore = Datastore()
    datastore.set_endpoints([Endpoint("10.0.0.1", 8000)])
    config = FlowControlConfig.model_validate(
        {"maxRequestsPerEndpoint": 4, "useSaturationDetector": False, "dispatchInterval": 0.005}
    )
    flow = FlowController(
        config, datastore, SaturationDetector(5, 0.8, 2.0), FlowControlMetrics(CollectorRegistry())
    )
    state = datastore.get("10.0.0.1:8000")
    assert state is not None
    state.metrics = Metrics(running=3, waiting=0, updated_at=time.monotonic())  # others' 3
    first = await flow.admit(0, "default", 10)  # the fourth slot
    waiter = asyncio.ensure_future(flow.admit(0, "default", 10))
    await asyncio.sleep(0.05)
    assert not waiter.done()  # the pool is full although this replica holds one request
    state.metrics = Metrics(running=2, waiting=0, updated_at=time.monotonic())  # one ended
    await asyncio.wait_for(waiter, 2)
    flow.release(first)
    flow.release(waiter.result())
    await flow.close()


POST = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json"}


async def _route_once(channel: Any, prompt: str, extra: dict[str, str]) -> tuple[Any, Stream]:
    """Route one request; its header mutation and its still open stream (the request is
    in flight until the stream closes)."""
    stream = Stream(channel)
    payload = json.dumps({"model": "tiny", "prompt": prompt}).encode()
    await stream.send(headers({**POST, **extra}), body(payload))
    answer, _ = await stream.recv(2)
    return answer.request_headers.response.header_mutation, stream


async def test_the_epp_learns_other_replicas_admissions_not_its_own(
    epp_factory: Any, channel_for: Any
) -> None:
    engines = [Endpoint("127.0.0.1", 18001), Endpoint("127.0.0.1", 18002)]
    epp = await epp_factory(static_endpoints=engines)
    scorer = epp.plugin_context.extras["prefix_index"]
    channel = channel_for(epp)
    mutation, stream = await _route_once(channel, "a long shared document " * 30, {})
    sent = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    packed = decode_prefix(sent[PREFIX_HEADER])
    key, picked = sent["x-infergate-request-id"], sent["x-gateway-destination-endpoint"]
    other = next(e.key for e in engines if e.key != picked)
    # Its own request's admission record: already in its index, not counted again.
    epp.ext_proc.on_record(picked, CompletionRecord(key, ADMITTED, 0, 0, 0, 1.0, packed))
    assert scorer.learned_blocks == 0
    await stream.close()
    # Another replica sent the same prompt to the other engine: learned there.
    epp.ext_proc.on_record(other, CompletionRecord("elsewhere", ADMITTED, 0, 0, 0, 1.0, packed))
    assert scorer.learned_blocks == len(prefix_hashes(packed))
    assert scorer.index.match(prefix_hashes(packed)).get(other) == len(prefix_hashes(packed))
    # A bad record changes nothing and finishes nothing.
    epp.ext_proc.on_record(other, CompletionRecord("bad", ADMITTED, 0, 0, 0, 1.0, b"x" * 9))
    assert scorer.learned_blocks == len(prefix_hashes(packed))
    # A client's own copy of the header never reaches an engine.
    short, stream = await _route_once(channel, "hi", {PREFIX_HEADER: "AAAAAAAAAAA"})
    await stream.close()
    assert PREFIX_HEADER in short.remove_headers
    assert PREFIX_HEADER not in {h.header.key for h in short.set_headers}


async def test_a_clients_order_delay_never_reaches_an_engine(
    epp_factory: Any, channel_for: Any
) -> None:
    """``x-infergate-order-delay`` places a request in the engine's queue: only the EPP
    sets it. With the default profile the pick's own value overwrites a client's; with a
    weight of 0 the client's copy is removed."""
    engines = [Endpoint("127.0.0.1", 18001), Endpoint("127.0.0.1", 18002)]
    channel = channel_for(await epp_factory(static_endpoints=engines))
    mutation, stream = await _route_once(channel, "hi", {ORDER_DELAY_HEADER: "3600"})
    await stream.close()
    sent = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    assert 0 < float(sent[ORDER_DELAY_HEADER]) < 60  # the EPP's estimate, not the 3,600 s
    config = DEFAULT_CONFIG_YAML.replace(
        "- type: predicted-latency-scorer\n",
        "- type: predicted-latency-scorer\n  parameters: {engineOrderWeight: 0}\n",
    )
    assert config != DEFAULT_CONFIG_YAML
    channel = channel_for(await epp_factory(static_endpoints=engines, config_text=config))
    mutation, stream = await _route_once(channel, "hi", {ORDER_DELAY_HEADER: "0"})
    await stream.close()
    assert ORDER_DELAY_HEADER in mutation.remove_headers
    assert ORDER_DELAY_HEADER not in {h.header.key for h in mutation.set_headers}


async def test_the_routing_replica_calibrates_from_its_own_admission_record_once(
    epp_factory: Any, channel_for: Any
) -> None:
    """Characters per token are learned as the engine takes the prompt (its admission
    record), not a whole response later. (That the completion does not count the same
    request again is pinned on the scorer itself, in test_routing_model.py: this EPP
    reports no completions, so its stream is gone once closed.)"""
    engines = [Endpoint("127.0.0.1", 18001), Endpoint("127.0.0.1", 18002)]
    epp = await epp_factory(static_endpoints=engines)
    calibration = epp.plugin_context.calibration
    channel = channel_for(epp)
    prompt = "a long shared document " * 30  # 690 characters
    mutation, stream = await _route_once(channel, prompt, {})
    sent = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    key, picked = sent["x-infergate-request-id"], sent["x-gateway-destination-endpoint"]
    assert calibration.samples("tiny") == 0
    epp.ext_proc.on_record(picked, CompletionRecord(key, ADMITTED, 460, 0, 0, 1.0))
    assert calibration.samples("tiny") == 1
    assert calibration.chars_per_token("tiny") == pytest.approx(len(prompt) / 460)
    # A repeated admission record (or one with no count) adds no second sample.
    epp.ext_proc.on_record(picked, CompletionRecord(key, ADMITTED, 100, 0, 0, 1.0))
    epp.ext_proc.on_record(picked, CompletionRecord(key, ADMITTED, 0, 0, 0, 1.0))
    assert calibration.samples("tiny") == 1
    await stream.close()
    epp.ext_proc.on_record(picked, CompletionRecord(key, 200, 460, 4, 0, 2.0))
    assert calibration.samples("tiny") == 1
    # Another replica's admission record calibrates nothing here (its chars are unknown).
    epp.ext_proc.on_record(picked, CompletionRecord("elsewhere", ADMITTED, 9, 0, 0, 1.0))
    assert calibration.samples("tiny") == 1
