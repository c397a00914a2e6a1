"""Burst accounting: requests that arrive in the same instant are placed with the cost of
those placed before them (their prefill, KV blocks and slots), through the real Director
and the built-in default profile, on a clock frozen for the burst (no time passes between
its requests, as when they share a timestamp)."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

from infergate.epp.config import load_config
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.datalayer.objectives import ObjectiveStore
from infergate.epp.flowcontrol.saturation import SaturationDetector
from infergate.epp.observability import EppMetrics
from infergate.epp.requestcontrol.director import Director
from infergate.epp.scheduling.plugins import PluginContext
from infergate.epp.scheduling.scheduler import Scheduler
from infergate.epp.types import Endpoint, EndpointState, InferenceRequest, Metrics

#: Index characters per token before any calibration (the prefix index's starting guess).
CPT = 4


class Fleet:
    """Four engines behind the default profile's Director, reports taken at ``now``."""

    def __init__(self, n: int = 4, blocks: int = 8000) -> None:
        self.now = time.monotonic()
        self.datastore = Datastore()
        self.datastore.set_endpoints(Endpoint(f"10.0.0.{i + 1}", 8000) for i in range(n))
        self.states = self.datastore.all()
        for state in self.states:
            self.report(state, blocks=blocks)
        saturation = SaturationDetector(5, 0.8, 2.0)
        metrics = EppMetrics(self.datastore, saturation)
        context = PluginContext(self.datastore, saturation, {"metrics": metrics})
        scheduler = Scheduler.from_config(load_config(None), context, metrics.plugin_timer)
        scheduler.plugins["predicted-latency-scorer"].clock = lambda: self.now  # type: ignore[attr-defined]
        self.director = Director(self.datastore, scheduler, saturation, ObjectiveStore(), metrics)

    def report(self, state: EndpointState, **fields: Any) -> None:
        """A scrape of ``state``'s engine taken now (idle unless ``fields`` say otherwise)."""
        fields.setdefault("blocks", state.metrics.num_gpu_blocks or 8000)
        blocks = fields.pop("blocks")
        state.metrics = Metrics(
            block_size=16,
            num_gpu_blocks=blocks,
            counts_reported=True,
            updated_at=self.now,
            **fields,
        )

    async def burst(self, prompts: list[str], max_tokens: int = 64) -> list[str]:
        """Route ``prompts`` one after another at the same instant; the endpoint of each."""
        picked = []
        for i, prompt in enumerate(prompts):
            body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens})
            decision = await self.director.route(InferenceRequest(str(i), {}), body.encode(), None)
            picked.append(decision.result.targets[0].key)
        return picked


def text(tokens: int, seed: str) -> str:
    """A prompt of about ``tokens`` tokens (at the index's 4 characters a token)."""
    unit = f"{seed} "
    return (unit * (tokens * CPT // len(unit) + 1))[: tokens * CPT]


async def test_a_burst_of_identical_cold_prompts_spreads_over_idle_engines() -> None:
    """8 copies of one new 2,700-token prompt over 4 idle engines: 2 each. The first copy's
    blocks are "held" by its engine at once, but not computed yet: the second copy there
    would compute them again beside the first (in-progress hit), as on any other engine,
    and the first copy's prefill queues ahead of it, so it goes to an idle engine."""
    fleet = Fleet()
    picked = await fleet.burst([text(2700, "same")] * 8)
    assert sorted(Counter(picked).values()) == [2, 2, 2, 2]


async def test_a_burst_of_distinct_cold_prompts_spreads_over_idle_engines() -> None:
    fleet = Fleet()
    picked = await fleet.burst([text(2700, f"p{i}") for i in range(8)])
    assert sorted(Counter(picked).values()) == [2, 2, 2, 2]


async def _holder(fleet: Fleet, shared: str) -> str:
    """Place ``shared`` on one engine, then let its prefill finish and every engine report."""
    (holder,) = await fleet.burst([shared])
    fleet.now += 10.0
    for state in fleet.states:
        fleet.report(state)
    return holder


async def test_a_burst_sharing_a_held_prefix_stays_until_the_holders_queue_outweighs_the_hit() -> (
    None
):
    """A 3,000-token prefix held by one engine, a burst of 8 prompts of it with 1,200 new
    tokens each. On the holder the k-th request waits for the k-1 suffixes placed there
    before it (60 ms each) and shares steps with the last one; elsewhere it prefills all
    4,200 tokens (220 ms), and those 160 ms more delay the burst's requests placed after
    it (the work externality: k ÷ 4 of them per engine while the queue drains). So the
    holder takes the first 4, then the burst spills onto the idle engines, and every
    request goes where its predicted cost is least (not all to the holder, which looked
    best before the burst)."""
    fleet = Fleet()
    shared = text(3000, "system")
    holder = await _holder(fleet, shared)
    picked = await fleet.burst([shared + text(1200, f"q{i}") for i in range(8)])
    assert picked[:4] == [holder] * 4
    assert picked[4] != holder and len(set(picked)) >= 3


async def test_a_burst_sharing_a_held_prefix_spills_when_the_holders_kv_cache_is_full() -> None:
    """The holder's cache has room for two of the burst (each needs 100 new prompt tokens
    and 256 output tokens; 800 tokens free), its queue is empty and the hits save 3,000
    tokens each. The first two go there; the third would wait for a running request to
    finish (the two placed before it took the room), so it goes to an idle engine."""
    fleet = Fleet(blocks=400)  # 6,400 tokens each
    shared = text(3000, "system")
    holder = await _holder(fleet, shared)
    state = next(s for s in fleet.states if s.key == holder)
    fleet.report(state, blocks=400, running=2, kv_usage=1 - 800 / 6400)
    picked = await fleet.burst([shared + text(100, f"q{i}") for i in range(6)], max_tokens=256)
    assert picked[:2] == [holder, holder]
    assert picked[2] != holder


async def test_claims_end_with_the_request_or_with_a_report_that_shows_it() -> None:
    fleet = Fleet()
    director = fleet.director
    body = json.dumps({"model": "m", "prompt": text(1000, "x"), "max_tokens": 100}).encode()
    decision = await director.route(InferenceRequest("a", {}), body, None)
    state = decision.result.targets[0]
    assert state.claimed_requests == 1 and state.claimed_kv_tokens > 1000
    # A report the engine sampled before the request could reach it does not settle it.
    fleet.report(state)
    assert state.load() >= 1 and state.claimed_requests == 1
    fleet.now += 1.0
    fleet.report(state)
    state.load()  # reads the new report
    assert state.claimed_requests == 0 and state.claimed_kv_tokens == 0.0
    # A request that ends before any report releases its claim itself.
    from infergate.epp.framework.requestcontrol import ResponseInfo

    second = await director.route(InferenceRequest("b", {}), body, None)
    assert second.result.targets[0].claimed_requests == 1
    director.finish(second, ResponseInfo(status=500, complete=True))
    assert second.result.targets[0].claimed_requests == 0
    assert not second.result.targets[0].claims
