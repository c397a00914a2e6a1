"""The routing model's math: prefill cost fit, chars/token calibration, the capacity-aware
prefix index and its ground truth, and the predicted-latency scorer."""

from __future__ import annotations

import random
import time

import pytest
from infergate.engine.metrics import EngineMetrics
from infergate.epp.config import DEFAULT_CONFIG_YAML, parse_config
from infergate.epp.datalayer.calibration import TokenCalibration
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.datalayer.dialects import VLLM, parse_metrics
from infergate.epp.flowcontrol.saturation import SaturationDetector
from infergate.epp.framework.requestcontrol import ResponseInfo
from infergate.epp.framework.scheduling import SchedulingResult
from infergate.epp.observability import EppMetrics
from infergate.epp.prefill_cost import PRIOR_PER_TOKEN_S, PrefillCost
from infergate.epp.scheduling.plugins import REGISTRY, PluginContext
from infergate.epp.scheduling.prefix_index import PrefixIndex
from infergate.epp.types import CycleState, Endpoint, EndpointState, InferenceRequest, Metrics

BASE, PER_TOKEN = 0.006, 30e-6


def fleet(n: int, *, blocks: int = 600) -> list[EndpointState]:
    return [
        EndpointState(
            Endpoint(f"10.0.0.{i}", 8000),
            Metrics(block_size=16, num_gpu_blocks=blocks, updated_at=time.monotonic()),
        )
        for i in range(1, n + 1)
    ]


def context(states: list[EndpointState]) -> PluginContext:
    ds = Datastore()  # the plugins score the states they are handed
    saturation = SaturationDetector(5, 0.8, 2.0)
    return PluginContext(ds, saturation, {"metrics": EppMetrics(ds, saturation)})


def plugin(type_name: str, ctx: PluginContext, **params: object):
    cls = REGISTRY[type_name]
    return cls(type_name, cls.Params.model_validate(params), ctx)


# -- prefill cost ------------------------------------------------------------------------


def test_prefill_cost_recovers_base_and_per_token_from_counter_windows() -> None:
    rng = random.Random(0)
    cost = PrefillCost()
    t = s = n = p = 0.0
    clock = 0.0
    cost.observe_counters(0, 0, 0, 0, 0, now=clock)
    for _ in range(200):
        for _ in range(rng.randint(3, 12)):  # one 2 s window of finished requests
            prompt = rng.randint(50, 3000)
            cached = rng.choice([0, 0, prompt // 2, prompt - 16])
            n += 1
            p += prompt
            s += BASE + PER_TOKEN * (prompt - cached) * rng.uniform(0.9, 1.1)
            t += cached  # reused as the EPP-side cached-token tally
        clock += 2.0
        cost.observe_counters(s, n, p, 0, 0, now=clock, observed=(int(p), int(t)))
    assert cost.per_token == pytest.approx(PER_TOKEN, rel=0.1)
    assert cost.base == pytest.approx(BASE, abs=0.003)
    assert cost.seconds(1000) == pytest.approx(BASE + 1000 * PER_TOKEN, rel=0.1)


def test_prefill_cost_waits_for_a_window_and_survives_an_engine_restart() -> None:
    cost = PrefillCost()
    cost.observe_counters(10.0, 100, 1e5, 0, 0, now=0.0)
    cost.observe_counters(10.1, 102, 1.01e5, 0, 0, now=0.5)  # too short: no fit yet
    assert cost.observations == 0 and cost.per_token == PRIOR_PER_TOKEN_S
    cost.observe_counters(0.1, 1, 500, 0, 0, now=3.0)  # counters reset: new baseline only
    assert cost.observations == 0
    cost.observe_counters(1.1, 21, 40500, 0, 0, now=6.0)
    assert cost.observations == 1 and cost.per_token > 0 and cost.base >= 0


def test_engine_metrics_feed_the_cost_model_fields() -> None:
    m = EngineMetrics("m", block_size=16, num_gpu_blocks=600)
    m.bind(lambda: 1, lambda: 2, lambda: 0.5)
    m.prefix_queries.inc(1000)
    m.prefix_hits.inc(400)
    m.prefill_time.observe(0.25)
    m.request_prompt_tokens.observe(1000)
    snap = parse_metrics(m.render(), VLLM)
    assert snap.capacity_tokens == 9600
    assert (snap.prefill_seconds_sum, snap.prefill_count) == (0.25, 1.0)
    assert (snap.prompt_tokens_total, snap.prefix_hits_total, snap.prefix_queries_total) == (
        1000.0,
        400.0,
        1000.0,
    )


# -- characters per token ----------------------------------------------------------------


def test_calibration_learns_chars_per_token_per_model() -> None:
    cal = TokenCalibration()
    assert cal.chars_per_token("a") == 4.0  # GIE's guess until a response says otherwise
    for _ in range(50):
        cal.observe("a", 1500, 1000)
    cal.observe("b", 4000, 1000)
    assert cal.chars_per_token("a") == pytest.approx(1.5)
    assert cal.chars_per_token("b") == pytest.approx(4.0)
    assert cal.tokens("a", 3000) == pytest.approx(2000)
    cal.observe("a", 0, 10)  # nonsense is ignored
    cal.observe("a", 10, 0)
    assert cal.samples("a") == 50


# -- the prefix index --------------------------------------------------------------------


def test_index_capacity_follows_the_engine_and_drops_older_entries() -> None:
    index = PrefixIndex(capacity_per_server=100)
    index.add("a", [1, 2, 3, 4])
    index.set_capacity("a", 3)  # shrinking evicts the least recently used
    assert index.match([1]) == {} and index.match([2, 3, 4]) == {"a": 3}
    index.add("a", [2])  # 2 is now the most recent
    seq_of_3 = index.last_use("a", 3)
    assert seq_of_3 is not None
    assert index.drop_older_than("a", seq_of_3) == 1  # only 3 (4 and 2 are newer)
    assert index.match([2]) == {"a": 1} and index.match([3]) == {}


async def test_prefix_index_sized_from_cache_config_and_learned_chars_per_token() -> None:
    """An endpoint's index capacity follows its reported cache where it is read (its free
    room scored), not in a pass over the pool on every request."""
    states = fleet(1, blocks=100)  # 1,600 tokens
    ctx = context(states)
    prefix = plugin("prefix-cache-scorer", ctx)  # 64-character blocks
    # 4 chars/token until calibrated: 1,600 tokens × 4 / 64 = 100 blocks, all free.
    assert prefix.free_tokens(states[0], "") == prefix.tokens_for_blocks("", 100)
    assert prefix.index.capacity_of(states[0].key) == 100
    for _ in range(30):
        ctx.calibration.observe("", 1600, 1000)  # 1.6 chars/token
    prefix.free_tokens(states[0], "")
    assert prefix.index.capacity_of(states[0].key) == 40


async def test_chars_per_token_are_learned_at_admission_once_per_request() -> None:
    """The engine's admission record calibrates the request's characters per token; its
    completion does not add the same request again; a prompt list or a stored
    conversation (text the EPP did not hash) calibrates nothing."""
    states = fleet(1, blocks=10_000)
    ctx = context(states)
    prefix = plugin("prefix-cache-scorer", ctx)
    target = SchedulingResult("p", [states[0]])

    async def routed(body: dict[str, object], text: str, previous: str = "") -> InferenceRequest:
        r = InferenceRequest("r", {}, body=body, prompt_text=text, model="m")
        r.previous_response_id = previous
        cycle = CycleState()
        await prefix.prepare(cycle, r, states)
        prefix.pre_request(cycle, r, target)
        return r

    r = await routed({"prompt": "x" * 600}, "x" * 600)
    prefix.request_admitted(r, target, 500)  # 1.2 characters per token
    assert (ctx.calibration.samples("m"), ctx.calibration.chars_per_token("m")) == (1, 1.2)
    prefix.request_admitted(r, target, 50)  # at most once per request
    done = ResponseInfo(status=200, prompt_tokens=500, cached_tokens=0, complete=True)
    prefix.response_complete(r, target, done)
    assert ctx.calibration.samples("m") == 1
    batch = await routed({"prompt": ["y" * 300, "y" * 300]}, "y" * 600)
    prefix.request_admitted(batch, target, 10)  # the first prompt's count only
    stored = await routed({"input": "z" * 60}, "z" * 60, previous="resp_1")
    prefix.request_admitted(stored, target, 4000)  # the engine prepended the history
    assert (ctx.calibration.samples("m"), ctx.calibration.chars_per_token("m")) == (1, 1.2)
    # Without an admission record (an engine that publishes none) the response calibrates.
    late = await routed({"prompt": "w" * 600}, "w" * 600)
    prefix.response_complete(late, target, done)
    assert ctx.calibration.samples("m") == 2


async def test_a_cached_tokens_miss_drops_what_the_engine_evicted() -> None:
    """The index predicts a hit for group A; the engine reports 0 cached tokens (it
    evicted A): A's stale entry goes, and so does everything last used before it."""
    states = fleet(1, blocks=10_000)
    ctx = context(states)
    prefix = plugin("prefix-cache-scorer", ctx)
    key = states[0].key
    metrics: EppMetrics = ctx.extras["metrics"]
    old, group_a, newer = "o" * 640, "a" * 640, "n" * 640

    async def route(text: str, cached: int | None = None) -> None:
        r = InferenceRequest("r", {}, prompt_text=text, model="m", target_model="m")
        cycle = CycleState()
        await prefix.prepare(cycle, r, states)
        prefix.pre_request(cycle, r, SchedulingResult("p", [states[0]]))
        if cached is not None:
            done = ResponseInfo(status=200, prompt_tokens=160, cached_tokens=cached, complete=True)
            prefix.response_complete(r, SchedulingResult("p", [states[0]]), done)

    for _ in range(30):  # calibrate: 640 characters are 160 tokens
        ctx.calibration.observe("m", 640, 160)
    await route(old)
    await route(group_a)
    await route(newer)
    assert prefix.index.size(key) == 30
    await route(group_a, cached=0)  # predicted 10 blocks, the engine had none
    assert prefix.dropped_stale == 10  # "old" was used before A: the engine lost it too
    assert prefix.index.match(prefix_hashes(prefix, old)) == {}
    assert prefix.index.match(prefix_hashes(prefix, newer)) == {key: 10}  # newer stays
    assert prefix.index.match(prefix_hashes(prefix, group_a)) == {key: 10}  # recomputed
    assert metrics.prediction_accuracy() == 0.0  # one check, a false hit
    assert prefix.capacity_scale[key] == pytest.approx(0.98)  # the index was too big
    await route(group_a, cached=144)  # the engine had it: a correct prediction
    assert metrics.prediction_accuracy() == 0.5
    prefix.index.clear_server(key)  # the index forgets everything; the engine does not
    await route(newer, cached=144)  # a missed hit: the engine keeps more than modelled
    assert prefix.capacity_scale[key] == pytest.approx(0.98 * 1.02)


def prefix_hashes(prefix, text: str) -> list[int]:
    from infergate.epp.scheduling.prefix_index import block_hashes

    return block_hashes("m", "", text.encode(), prefix.block_chars, prefix.max_blocks)


# -- predicted latency -------------------------------------------------------------------


def pinned(states: list[EndpointState]) -> None:
    for s in states:
        s.cost.base, s.cost.per_token = BASE, PER_TOKEN


async def schedule(ctx: PluginContext, states: list[EndpointState], text: str, scorer):
    prefix = ctx.extras["prefix_index"]
    r = InferenceRequest("r", {}, prompt_text=text, model="m", target_model="m")
    cycle = CycleState()
    await prefix.prepare(cycle, r, states)
    scores = scorer.score(cycle, r, states)
    best = max(range(len(states)), key=lambda i: scores[i])
    result = SchedulingResult("p", [states[best]])
    prefix.pre_request(cycle, r, result)
    scorer.pre_request(cycle, r, result)
    return best, scores, cycle


def latency_fleet(n: int, blocks: int, **params: object):
    """``n`` endpoints of ``blocks`` × 16 tokens with pinned prefill costs, the prefix index,
    a predicted-latency scorer (``params``) on a clock the test moves (``now[0]``), and 4
    characters per token learned. Returns (states, context, scorer, now)."""
    states = fleet(n, blocks=blocks)
    pinned(states)
    ctx = context(states)
    plugin("prefix-cache-scorer", ctx)
    scorer = plugin("predicted-latency-scorer", ctx, **params)
    now = [100.0]
    scorer.clock = lambda: now[0]
    for _ in range(30):
        ctx.calibration.observe("m", 4000, 1000)  # 4 chars/token
    return states, ctx, scorer, now


async def test_predicted_ttft_prefers_the_holder_then_spreads_when_it_is_overloaded() -> None:
    states, ctx, scorer, now = latency_fleet(2, 10_000, decodeSecondsPerRequest=0.0)
    group = "g" * 8000
    first, _, _ = await schedule(ctx, states, group + " q0", scorer)
    holder, other = states[first], states[1 - first]
    # The holder's clock now carries the cold prefill: 2,001 tokens × 30 µs ≈ 60 ms, plus
    # their attention over a mean context of 1,000 tokens (attentionContextTokens 30k).
    cold = 2001 * PER_TOKEN * (1 + 1000.5 / 30000)
    assert holder.prefill_busy_until - now[0] == pytest.approx(cold, rel=0.005)
    now[0] += 1.0  # the work drained
    picked, scores, cycle = await schedule(ctx, states, group + " q1", scorer)
    assert states[picked] is holder and scores[first] == 1.0
    predicted = cycle["latency.predicted"]
    # Holder: base + ~1 block uncached; other: base + the whole prompt.
    assert predicted[holder.key] < 0.01 < 0.06 < predicted[other.key]
    # Overload the holder with 0.2 s of queued prefill: recomputing elsewhere (≈ 66 ms)
    # is now faster, so the group spreads to the second endpoint.
    holder.prefill_busy_until = now[0] + 0.2
    picked, _, _ = await schedule(ctx, states, group + " q2", scorer)
    assert states[picked] is other


async def _order_delay(**params: object) -> tuple[str | None, float]:
    """A cold 2,001-token prompt on an idle fleet: the order delay its pick carries, and
    the prefill work the pick added to the engine's clock."""
    from infergate.wire.names import ORDER_DELAY_HEADER

    states, ctx, scorer, now = latency_fleet(2, 10_000, **params)
    r = InferenceRequest("r", {}, prompt_text="c" * 8000, model="m", target_model="m")
    cycle = CycleState()
    await ctx.extras["prefix_index"].prepare(cycle, r, states)
    scorer.score(cycle, r, states)
    result = SchedulingResult("p", [states[0]])
    scorer.pre_request(cycle, r, result)
    return result.request_headers.get(ORDER_DELAY_HEADER), states[0].prefill_busy_until - now[0]


async def test_a_pick_asks_the_engine_to_order_it_by_its_weighted_prefill() -> None:
    """``x-infergate-order-delay`` = ``engineOrderWeight`` x the predicted prefill the pick
    adds to its engine (the engine orders its waiting queue by arrival + that); weight 0
    sends none."""
    delay, work = await _order_delay()  # the default weight, 2
    assert delay is not None and float(delay) == pytest.approx(2 * work, rel=1e-4)
    assert work > 0.05  # 2,001 uncached tokens at 30 µs
    delay, work = await _order_delay(engineOrderWeight=0.5)
    assert delay is not None and float(delay) == pytest.approx(0.5 * work, rel=1e-4)
    assert (await _order_delay(engineOrderWeight=0))[0] is None


def full_and_empty(**params: object):
    """Two endpoints of 3,200 tokens at 4 characters per token, the first one's prefix
    index nearly full; the prefix index and a predicted-latency scorer (``params``)."""
    states, ctx, scorer, _ = latency_fleet(2, 200, **params)
    full, empty = states
    ctx.extras["prefix_index"].index.add(full.key, list(range(10_000, 10_170)))  # ~full
    return states, ctx, scorer, full, empty


async def test_eviction_penalty_keeps_a_new_group_off_a_full_cache() -> None:
    states, ctx, scorer, full, empty = full_and_empty(evictionPenalty=1.0)
    _, _, cycle = await schedule(ctx, states, "new group " * 600, scorer)
    predicted = cycle["latency.predicted"]
    assert predicted[full.key] > predicted[empty.key]  # same wait, but eviction costs


def test_predicted_latency_params_are_validated() -> None:
    with pytest.raises(ValueError, match="evictionPenalty"):
        REGISTRY["predicted-latency-scorer"].Params.model_validate({"evictionPenalty": -1})
    with pytest.raises(ValueError, match="interferencePenalty"):
        REGISTRY["predicted-latency-scorer"].Params.model_validate({"interferencePenalty": -1})
    for bad in (-1, "lots"):
        with pytest.raises(ValueError, match="duplicationPenalty"):
            REGISTRY["predicted-latency-scorer"].Params.model_validate({"duplicationPenalty": bad})
    for wrong in (-0.1, "high"):
        with pytest.raises(ValueError, match="costTolerance"):
            REGISTRY["predicted-latency-scorer"].Params.model_validate({"costTolerance": wrong})
    with pytest.raises(ValueError, match=r"Extra inputs are not permitted"):
        REGISTRY["predicted-latency-scorer"].Params.model_validate({"weightz": 1})


# -- precise index: events plus speculative entries ---------------------------------------


def test_speculative_entries_count_until_events_confirm_or_they_expire() -> None:
    from infergate.epp.datalayer.kv_events import KVBlockIndex

    now = [0.0]
    index = KVBlockIndex(ttl=2.0, clock=lambda: now[0])
    index.stored("a", [1, 2])
    index.speculate("b", [1, 2, 3])  # just routed to b: its events have not arrived yet
    assert index.leading_matches([1, 2, 3]) == {"a": 2, "b": 3}
    index.stored("b", [1, 2])  # the engine confirms two of them
    assert set(index.speculative) == {3}
    now[0] = 5.0  # the third was never stored: the guess expires
    assert index.leading_matches([1, 2, 3]) == {"a": 2, "b": 2}
    index.speculate("a", [9])
    index.cleared("a")  # a total eviction drops guesses too
    assert index.leading_matches([9]) == {} and index.leading_matches([1]) == {"b": 1}


async def test_latency_prefers_the_precise_index_where_it_knows_more() -> None:
    states = fleet(2, blocks=10_000)
    pinned(states)
    ctx = context(states)
    plugin("prefix-cache-scorer", ctx)
    scorer = plugin("predicted-latency-scorer", ctx, decodeSecondsPerRequest=0.0)
    a, b = states
    cycle = CycleState(
        {
            "prefix.tokens": 900.0,  # the approximate estimate of the prompt's length...
            "prefix.cached_tokens": {a.key: 500.0},
            "precise.tokens": 1000,  # ...and the exact one, from the engine's tokenizer
            "precise.cached_tokens": {b.key: 992},  # KV events: b holds nearly all of it
        }
    )
    scorer.score(cycle, InferenceRequest("r", {}), states)
    uncached = cycle["latency.uncached"]
    assert uncached == {a.key: 500.0, b.key: 8.0}


async def test_an_endpoint_with_stale_metrics_is_predicted_slow() -> None:
    states = fleet(2, blocks=10_000)
    pinned(states)
    ctx = context(states)
    plugin("prefix-cache-scorer", ctx)
    scorer = plugin("predicted-latency-scorer", ctx)
    dead, alive = states
    dead.metrics.updated_at = time.monotonic() - 60  # no scrape for a minute
    alive.prefill_busy_until = time.monotonic() + 5.0  # even a long queue is better
    picked, _, _ = await schedule(ctx, states, "x" * 400, scorer)
    assert states[picked] is alive


async def test_a_prefill_another_replica_started_is_seen_from_the_engines_load_report() -> None:
    """Two replicas' view of one engine: replica B never routed there, so its own prefill
    clock says idle; the engine's load report says 3,000 prompt tokens are being prefilled
    (replica A's cold request). B must predict that wait and send the next cold request to
    the other, idle engine; once the report shows the prefill done, either will do."""
    states, ctx, scorer, now = latency_fleet(2, 10_000, decodeSecondsPerRequest=0.0)
    busy, idle = states
    for state in states:  # both push load reports, received at the scorer's clock
        state.metrics = Metrics(
            block_size=16, num_gpu_blocks=10_000, running=0, counts_reported=True,
            updated_at=now[0], tick=0.01, heartbeat=0.5,
        )  # fmt: skip
    busy.metrics = Metrics(
        block_size=16, num_gpu_blocks=10_000, running=1, counts_reported=True,
        prefill_pending_tokens=3000.0, updated_at=now[0], tick=0.01, heartbeat=0.5,
    )  # fmt: skip
    assert busy.prefill_busy_until == 0.0 and busy.in_flight_requests == 0  # not ours
    # 3,000 tokens x 30 us = 90 ms of someone else's prefill, 10 ms of it done since.
    now[0] += 0.01
    assert busy.pending_prefill_seconds(PER_TOKEN, now[0]) == pytest.approx(0.08)
    picked, _, cycle = await schedule(ctx, states, "c" * 4000, scorer)  # 1,000 cold tokens
    assert states[picked] is idle
    predicted = cycle["latency.predicted"]
    # The wait, and the delay this prompt would add to the prefill in progress there.
    interference = 1001 * PER_TOKEN
    assert predicted[busy.key] - predicted[idle.key] == pytest.approx(0.08 + interference, rel=0.05)
    # This replica's own pick counts on top of the report until the next report.
    assert idle.claimed_prefill_tokens == pytest.approx(1001, abs=2)
    assert idle.pending_prefill_seconds(PER_TOKEN, now[0]) == pytest.approx(
        1001 * PER_TOKEN, rel=0.01
    )
    # The next report shows the prefill done: the engine is idle again for everyone.
    busy.metrics = Metrics(
        block_size=16, num_gpu_blocks=10_000, running=1, counts_reported=True,
        updated_at=now[0], tick=0.01, heartbeat=0.5,
    )  # fmt: skip
    assert busy.pending_prefill_seconds(PER_TOKEN, now[0]) == 0.0
    picked, _, _ = await schedule(ctx, states, "d" * 4000, scorer)
    assert states[picked] is busy  # idle now carries this replica's 1,001-token prefill
    # A scraped endpoint carries no such report: the term is 0, as before.
    scraped = fleet(1)[0]
    scraped.metrics.prefill_pending_tokens = 5000.0
    assert scraped.pending_prefill_seconds(PER_TOKEN, time.monotonic()) == 0.0


async def test_an_engine_whose_waiting_queue_holds_prefill_is_not_predicted_free() -> None:
    """An engine with a full KV cache runs decodes and keeps requests waiting: nothing of
    its running requests is left to prefill, but its waiting requests' uncached prompts
    (the report's ``prefill_waiting_tokens``) come before a new request. Counting only the
    running ones, it looked free and took the next long prompt."""
    states, ctx, scorer, now = latency_fleet(2, 10_000, decodeSecondsPerRequest=0.0)
    queued, other = states
    other.metrics = Metrics(
        block_size=16, num_gpu_blocks=10_000, running=2, counts_reported=True,
        prefill_pending_tokens=4000.0, updated_at=now[0], tick=0.01, heartbeat=0.5,
    )  # fmt: skip
    queued.metrics = Metrics(
        block_size=16, num_gpu_blocks=10_000, running=2, waiting=2, counts_reported=True,
        prefill_waiting_tokens=20_000.0, updated_at=now[0], tick=0.01, heartbeat=0.5,
    )  # fmt: skip
    assert queued.pending_prefill_seconds(PER_TOKEN, now[0]) == pytest.approx(20_000 * PER_TOKEN)
    picked, _, cycle = await schedule(ctx, states, "w" * 4000, scorer)  # 1,000 cold tokens
    assert states[picked] is other  # 0.12 s of prefill ahead there, 0.6 s here
    predicted = cycle["latency.predicted"]
    assert predicted[queued.key] - predicted[other.key] > 0.4


async def test_a_cold_prompt_avoids_an_engine_still_prefilling_another() -> None:
    """Engine A is 5 ms from the end of a prefill; engine B prefills nothing but decodes 8
    requests (8 ms at 1 ms each). Predicting only the new request's TTFT, A is 2 ms sooner
    for a cold 2,000-token prompt; but sharing A's steps would delay the prefill in
    progress by the new prompt's 60 ms. So the cold prompt goes to B — while a request of
    a group A holds (a few uncached tokens, no delay to speak of) still goes to A."""

    async def pick(text: str, **params: object) -> str:
        states, ctx, scorer, now = latency_fleet(2, 10_000, decodeSecondsPerRequest=0.001, **params)
        a, b = states
        await schedule(ctx, [a], "g" * 8000 + " q0", scorer)  # A holds group g (1 running)
        now[0] += 1.0  # routed earlier (not this instant): A is in the step computing it
        a.prefill_busy_until = now[0] + 0.005
        b.metrics.running = 8
        picked, _, _ = await schedule(ctx, states, text, scorer)
        return "A" if states[picked] is a else "B"

    cold = "c" * 8000
    assert await pick(cold) == "B"
    assert await pick("g" * 8000 + " q1") == "A"
    assert await pick(cold, interferencePenalty=0.0) == "A"  # the own-TTFT-only policy


async def _copy_or_wait(fill: bool, busy_s: float, **params: object) -> tuple[str, float]:
    """Three engines of 3,200 tokens (200 index blocks): H holds group g and is still
    prefilling for ``busy_s`` more; C is idle with an empty cache; F is idle and full.
    With ``fill`` H's and F's caches are full (the fleet's index is 2/3 occupied), else
    only g is held (1/5). Returns which engine g's next request goes to, and the
    candidates' occupancy."""
    states, ctx, scorer, now = latency_fleet(3, 200, decodeSecondsPerRequest=0.0, **params)
    holder, _cold, full = states
    index = ctx.extras["prefix_index"]
    group = "g" * 8000  # 2,000 tokens: 125 index blocks (and the question's partial one)
    await schedule(ctx, [holder], group + " q0", scorer)
    now[0] += 1.0  # routed earlier (not this instant): H is in the step computing it
    if fill:
        index.index.add(holder.key, list(range(1, 75)))
        index.index.add(full.key, list(range(100, 300)))
    holder.prefill_busy_until = now[0] + busy_s
    for state in states:
        index.free_tokens(state, "m")  # refreshes each capacity, as the scorer does
    occupancy = index.occupancy(states)
    picked, _, _ = await schedule(ctx, states, group + " q1", scorer)
    return "HCF"[picked], occupancy


async def test_a_prefix_is_not_copied_into_free_cache_when_the_fleet_is_nearly_full() -> None:
    """H finishes its prefill in 80 ms; on C, recomputing g's 2,000 tokens takes 66 ms,
    so for this request alone C is sooner. But the copy takes 2,000 tokens of C's room
    that the next new group needs: on a fleet whose caches are 2/3 full it is charged
    2/3 of its recompute, and the request waits for its holder. On nearly empty caches
    the copy is almost free (C); a holder busy for 300 ms loses either way (the group
    spreads); without the charge the copy always wins."""
    assert await _copy_or_wait(fill=True, busy_s=0.08) == ("H", pytest.approx(400 / 600))
    assert (await _copy_or_wait(fill=False, busy_s=0.08))[0] == "C"
    assert (await _copy_or_wait(fill=True, busy_s=0.3))[0] == "C"
    assert (await _copy_or_wait(fill=True, busy_s=0.08, duplicationPenalty=0.0))[0] == "C"


# -- robustness: queueing behind a full cache, bounded load, adapters only when in play --


def _loaded(state: EndpointState, *, running: int, waiting: int, kv_usage: float) -> None:
    state.metrics.running, state.metrics.waiting = running, waiting
    state.metrics.kv_usage = kv_usage


async def _sticky_and_cold(lifetime: float, sticky_load: tuple[int, int, float]):
    """Two endpoints with 6,400-token caches: ``sticky`` holds the 2,000-token group prefix
    and carries ``sticky_load`` (running, waiting, KV usage); ``cold`` holds nothing and is
    idle. Returns the pick for the group's next request and the predictions."""
    states, ctx, scorer, now = latency_fleet(2, 400, decodeSecondsPerRequest=0.0)
    group = "g" * 8000  # 2,000 tokens
    first, _, _ = await schedule(ctx, states, group + " q0", scorer)
    sticky, cold = states[first], states[1 - first]
    scorer._lifetime[sticky.key] = lifetime  # learned from completions (T(e))
    now[0] += 5.0  # the prefill clock drained: only the engine's own queue remains
    _loaded(sticky, running=sticky_load[0], waiting=sticky_load[1], kv_usage=sticky_load[2])
    sticky.metrics.updated_at = now[0]  # a report taken now: it shows q0 (its claim settles)
    picked, _, cycle = await schedule(ctx, states, group + " q1", scorer)
    return states[picked] is sticky, sticky, cold, cycle["latency.predicted"]


async def test_a_saturated_sticky_engine_loses_when_its_queue_costs_more_than_the_hit() -> None:
    # The holder's cache is full (3 running, 2 waiting, 97 % used) and a request there
    # lives 0.5 s: it waits for the 2 queued ahead at 5 / 0.5 s = 10 completions per
    # second, 0.2 s. The prefill it saves is 2,000 tokens × 30 µs, and their attention
    # (× 1 + 1,000 / 30,000), 62 ms: the idle cold engine wins, by 0.2 − 0.062 s. (A
    # pure-affinity policy picks the holder here.)
    stays, sticky, cold, predicted = await _sticky_and_cold(0.5, (3, 2, 0.97))
    assert not stays
    assert predicted[sticky.key] - predicted[cold.key] == pytest.approx(0.2 - 0.062, abs=0.01)


async def test_a_busier_sticky_engine_keeps_its_group_while_the_queue_is_cheaper() -> None:
    # The holder runs 2 requests and has room (40 % used, none waiting): no queue, so the
    # 60 ms of prefill it saves wins although it is the busier engine. (A pure-load policy
    # picks the idle cold engine here.)
    stays, sticky, cold, predicted = await _sticky_and_cold(0.5, (2, 0, 0.4))
    assert stays and sticky.metrics.running > cold.metrics.running
    assert predicted[cold.key] - predicted[sticky.key] > 0.05


async def test_a_short_queue_still_loses_to_a_long_prefill() -> None:
    # Same full holder, but its requests are short-lived (60 ms): the queue (2 × 60 ms ÷ 5
    # = 24 ms) is cheaper than recomputing the 60 ms prefix elsewhere, so the group stays.
    stays, _, _, _ = await _sticky_and_cold(0.06, (3, 2, 0.97))
    assert stays


async def _hit_on_a_full_holder(*, first_still_running: bool) -> bool:
    """The holder has the 2,000-token group prefix cached and runs 2 other requests that
    leave 1,000 tokens of its 6,400 free; the other engine is idle. The group's next
    request (2,001 prompt tokens, 128 output) would hit 2,000 there. Whether it stays."""
    states, ctx, scorer, now = latency_fleet(2, 400, decodeSecondsPerRequest=0.0)
    prefix = ctx.extras["prefix_index"]
    group = "g" * 8000
    first = InferenceRequest("q0", {}, prompt_text=group + " q0", model="m", target_model="m")
    cycle = CycleState()
    await prefix.prepare(cycle, first, states)
    scorer.score(cycle, first, states)
    result = SchedulingResult("p", [states[0]])
    prefix.pre_request(cycle, first, result)
    scorer.pre_request(cycle, first, result)
    holder = states[0]
    if not first_still_running:  # it finished: its blocks stay cached, referenced by none
        scorer.response_complete(first, result, ResponseInfo(status=200, prompt_tokens=2001))
    scorer._lifetime[holder.key] = 0.5
    now[0] += 5.0
    _loaded(holder, running=2, waiting=0, kv_usage=1 - 1000 / 6400)
    holder.metrics.updated_at = now[0]
    picked, _, _ = await schedule(ctx, states, group + " q1", scorer)
    return states[picked] is holder


async def test_a_hit_on_blocks_no_running_request_holds_needs_their_room_too() -> None:
    """A hit on a prefix left by a finished request takes those blocks out of the free
    cache (vLLM counts them free), so it needs 2,129 tokens where 1,000 are free: it would
    wait for one of the 2 running requests to finish (0.5 s ÷ 2 = 0.25 s), more than the
    62 ms it saves, and goes to the idle engine. While a running request shares the
    prefix it needs only its 129 new tokens, and stays. (Counting only the uncached
    tokens, it stayed in both cases and waited.)"""
    assert not await _hit_on_a_full_holder(first_still_running=False)
    assert await _hit_on_a_full_holder(first_still_running=True)


def test_running_prefixes_finds_the_longest_prefix_shared_with_a_request_in_flight() -> None:
    from infergate.epp.scheduling.plugins.latency import SHARED_STRIDE, RunningPrefixes

    rng = random.Random(3)
    blocks = [rng.getrandbits(64).to_bytes(8, "little") for _ in range(200)]

    def prompt(shared: int, length: int, tag: int) -> bytes:
        """``shared`` blocks of the common chain, then blocks of its own (a new chain)."""
        own = [bytes([tag, i % 256, i // 256]) + b"\xff" * 5 for i in range(length - shared)]
        return b"".join(blocks[:shared] + own)

    running = RunningPrefixes()
    a, b = prompt(37, 60, 1), prompt(90, 95, 2)
    running.add("e", a, RunningPrefixes.sample(a))
    assert running.shared_blocks("e", prompt(200, 200, 0)) == 37
    assert running.shared_blocks("f", prompt(200, 200, 0)) == 0  # another endpoint
    running.add("e", b, RunningPrefixes.sample(b))
    assert running.shared_blocks("e", prompt(120, 150, 3)) == 90
    assert running.shared_blocks("e", prompt(50, 150, 3)) == 50
    assert running.shared_blocks("e", b) == 95  # the same prompt: all of it
    assert running.shared_blocks("e", prompt(3, 150, 3)) == 3
    assert running.shared_blocks("e", prompt(0, 150, 3)) == 0
    running.remove("e", b, RunningPrefixes.sample(b))
    # b ended; a remains. Which prompt of those sharing block 32 is the newest is no longer
    # known, so the count stops there: within one stride, never more than is shared.
    assert 37 - SHARED_STRIDE < running.shared_blocks("e", prompt(120, 150, 3)) <= 37
    running.remove("e", a, RunningPrefixes.sample(a))
    assert running.shared_blocks("e", prompt(120, 150, 3)) == 0


async def _spill_or_stay(recent_picks: int, **params: object) -> str:
    """Two engines: the holder of a 2,000-token prefix with 100 ms of prefill queued, the
    other idle; ``recent_picks`` picks 10 ms ago. Where the group's next request (2,001
    tokens) goes: "H" or "O"."""
    states, ctx, scorer, now = latency_fleet(2, 10_000, decodeSecondsPerRequest=0.0, **params)
    group = "g" * 8000
    first, _, _ = await schedule(ctx, states, group + " q0", scorer)
    holder = states[first]
    now[0] += 5.0
    scorer._pick_times[:] = [now[0] - 0.01] * recent_picks
    holder.prefill_busy_until = now[0] + 0.1
    picked, _, _ = await schedule(ctx, states, group + " q1", scorer)
    return "H" if states[picked] is holder else "O"


async def test_recomputing_a_prefix_elsewhere_is_charged_the_delay_it_adds_to_later_requests() -> (
    None
):
    """Recomputing the 2,000-token prefix on the idle engine takes 62 ms, less than the
    holder's 100 ms queue, so for this request alone the idle engine is sooner. But the
    fleet's queue (mean wait 50 ms) has seen 8 picks in its last 50 ms: 4 per engine
    arrive while it drains and each waits behind the 62 ms spent, so the holder wins.
    With no recent arrivals, or with the externality off, the request takes the idle
    engine."""
    assert await _spill_or_stay(8) == "H"
    assert await _spill_or_stay(0) == "O"
    assert await _spill_or_stay(8, workExternality=0.0) == "O"


def test_queue_seconds_follows_littles_law() -> None:
    from infergate.epp.scheduling.plugins.latency import queue_seconds

    (e,) = fleet(1, blocks=400)  # 6,400 tokens
    assert queue_seconds(e, 2000, 1.0) == 0.0  # idle
    _loaded(e, running=2, waiting=0, kv_usage=0.5)
    assert queue_seconds(e, 2000, 1.0) == 0.0  # 3,200 tokens free: room now
    _loaded(e, running=3, waiting=0, kv_usage=0.9)  # 640 free; each running holds 1,920
    # ⌈(2,000 − 640) ÷ 1,920⌉ = 1 completion, at 3 per second (T = 1 s, n = 3).
    assert queue_seconds(e, 2000, 1.0) == pytest.approx(1 / 3)
    _loaded(e, running=3, waiting=3, kv_usage=0.9)  # and 3 queued ahead: 4 of 6 per second
    assert queue_seconds(e, 2000, 1.0) == pytest.approx(4 / 6)
    e.metrics.num_gpu_blocks = 0  # no reported cache size: only the reported queue counts
    assert queue_seconds(e, 2000, 1.0) == pytest.approx(3 / 6)


def test_bounded_load_filter_keeps_endpoints_within_the_factor_of_the_fair_share() -> None:
    states = fleet(4)
    ctx = context(states)
    bounded = plugin("bounded-load-filter", ctx, loadFactor=1.25, loadSlack=0)
    r = InferenceRequest("r", {}, model="m", target_model="m")
    for state, load in zip(states, (9, 3, 2, 1), strict=True):
        state.in_flight_requests = load
    # Σ = 15, +1 for this request, over 4: fair share 4, bound ⌈1.25 × 4⌉ = 5.
    kept = bounded.filter(CycleState(), r, list(states))
    assert kept == states[1:]
    # The engine's own report counts too (requests from other routers or replicas).
    states[1].metrics.running, states[1].metrics.waiting = 5, 3  # load 8 > ⌈1.25 × 21 ÷ 4⌉
    assert states[1] not in bounded.filter(CycleState(), r, list(states))
    slack = plugin("bounded-load-filter", ctx, loadFactor=1.25, loadSlack=1)
    assert states[1] in slack.filter(CycleState(), r, list(states))  # 8 ≤ 7 + 1
    # Never empty: the least loaded endpoint is always within the bound.
    for state in states:
        state.in_flight_requests, state.metrics.running, state.metrics.waiting = 50, 0, 0
    states[3].in_flight_requests = 0
    assert states[3] in bounded.filter(CycleState(), r, list(states))
    with pytest.raises(ValueError, match="loadFactor"):
        REGISTRY["bounded-load-filter"].Params.model_validate({"loadFactor": 0.5})


def test_lora_affinity_is_neutral_unless_the_request_is_for_an_adapter() -> None:
    states = fleet(3)
    ctx = context(states)
    lora = plugin("lora-affinity-scorer", ctx)

    def scores(model: str) -> list[float]:
        r = InferenceRequest("r", {}, model=model, target_model=model)
        return lora.score(CycleState(), r, states)

    assert scores("base") == [1.0, 1.0, 1.0]  # no endpoint reports adapter slots
    for state in states:
        state.metrics.max_active_models = 2
    states[0].metrics.active_models = frozenset({"lora-a"})
    states[1].metrics.active_models = frozenset({"lora-b", "lora-c"})
    assert scores("base") == [1.0, 1.0, 1.0]  # the base model is no adapter
    # An adapter: running on 0 > a free slot on 2 > both slots taken on 1.
    assert scores("lora-a") == [1.0, 0.0, 0.8]


async def test_the_eviction_charge_scales_with_how_often_evicted_tokens_are_reused() -> None:
    states, ctx, scorer, full, empty = full_and_empty(evictionPenalty=1.0)
    prefix = ctx.extras["prefix_index"]

    async def eviction_charge() -> float:
        """Predicted TTFT on the full cache minus on the empty one (scored, not routed)."""
        r = InferenceRequest("r", {}, prompt_text="new group " * 600, model="m", target_model="m")
        cycle = CycleState()
        await prefix.prepare(cycle, r, states)
        scorer.score(cycle, r, states)
        return cycle["latency.predicted"][full.key] - cycle["latency.predicted"][empty.key]

    charge = await eviction_charge()
    assert scorer.reuse == 1.0 and charge > 0  # nothing observed yet: every token counts
    # The fleet reports that a quarter of prompt tokens were cache hits lately: evicted
    # blocks are read again a quarter as often, so the charge falls to a quarter.
    request = InferenceRequest("x", {}, model="m", target_model="m")
    request.notes["latency.routed_at"] = scorer.clock()
    # A fleet's first responses are its compulsory misses: they do not make evictions
    # look free at once (a prior of 8 full hits the size of the first response).
    cold = ResponseInfo(status=200, prompt_tokens=1000, cached_tokens=0)
    scorer.response_complete(request, SchedulingResult("p", [empty]), cold)
    assert scorer.reuse == pytest.approx(8 * 0.995 / (8 * 0.995 + 1), rel=1e-6)
    for _ in range(2000):
        response = ResponseInfo(status=200, prompt_tokens=1000, cached_tokens=250)
        scorer.response_complete(request, SchedulingResult("p", [empty]), response)
    assert scorer.reuse == pytest.approx(0.25, abs=0.01)
    assert await eviction_charge() == pytest.approx(charge * 0.25, rel=0.05)


async def test_pinned_costs_replace_the_learned_ones() -> None:
    # Learned: 6 ms + 30 µs per token; pinned: 0.5 s + 1 ms per token.
    states, ctx, scorer, _ = latency_fleet(1, 10_000, secondsPerToken=1e-3, baseSeconds=0.5)
    _, _, cycle = await schedule(ctx, states, "p" * 4000, scorer)  # 1,000 tokens
    (predicted,) = cycle["latency.predicted"].values()
    assert predicted == pytest.approx(0.5 + 1000 * 1e-3, rel=0.02)


def _fitted(state: EndpointState, per_token: float, windows: int = 5) -> None:
    state.cost.base, state.cost.per_token, state.cost.observations = BASE, per_token, windows


async def test_fits_within_the_tolerance_of_the_median_predict_alike() -> None:
    # Identical engines whose fits differ by 2-3 %: with the tolerance, an idle fleet is a
    # tie (the picker spreads it); without it, the cheapest-looking engine wins every time.
    for tolerance, alike in ((0.15, True), (0.0, False)):
        states, ctx, scorer, _ = latency_fleet(3, 10_000, costTolerance=tolerance)
        for state, per_token in zip(states, (30.0e-6, 30.6e-6, 30.9e-6), strict=True):
            _fitted(state, per_token)
        _, _, cycle = await schedule(ctx, states, "q" * 4000, scorer)  # 1,000 cold tokens
        predicted = [cycle["latency.predicted"][s.key] for s in states]
        assert (len(set(predicted)) == 1) is alike, (tolerance, predicted)
        if not alike:
            assert predicted[0] < predicted[1] < predicted[2]


async def test_an_engine_slower_than_the_tolerance_keeps_its_own_cost() -> None:
    states, ctx, scorer, _ = latency_fleet(3, 10_000)
    for state, per_token in zip(states, (30e-6, 31e-6, 60e-6), strict=True):
        _fitted(state, per_token)
    picked, _, cycle = await schedule(ctx, states, "q" * 4000, scorer)
    predicted = cycle["latency.predicted"]
    assert predicted[states[2].key] == pytest.approx(BASE + 60e-6 * 1000, rel=0.02)
    # The two alike ones are read as their median, 31 µs; the slow one as itself.
    assert predicted[states[0].key] == pytest.approx(BASE + 31e-6 * 1000, rel=0.02)
    assert picked != 2


async def test_a_fit_far_cheaper_than_its_peers_does_not_draw_every_long_prompt() -> None:
    """A degenerate fit (the base took all the time, ``per_token`` 0) read as such made its
    engine look able to prefill any prompt at once: it took each long prompt, and its
    clock, advanced by that cheap work, never showed the queue. Read as the median, the
    first long prompt may go there, but the clock then holds its real work and the next
    one goes elsewhere."""
    states, ctx, scorer, now = latency_fleet(3, 10_000)
    for state, per_token in zip(states, (30e-6, 31e-6, 0.0), strict=True):
        _fitted(state, per_token)
    broken = states[2]
    picks = []
    for n in range(3):  # 20,000 cold tokens each, arriving together
        picked, _, cycle = await schedule(ctx, states, f"{n} " + "q" * 80_000, scorer)
        picks.append(picked)
        predicted = cycle["latency.predicted"]
        if n == 0:  # an idle fleet: the broken engine is predicted as its peers
            assert predicted[broken.key] == pytest.approx(predicted[states[0].key])
    assert sorted(picks) == [0, 1, 2]  # one each: no engine's clock stayed empty
    held = [s.prefill_busy_until - now[0] for s in states]
    assert held[2] == pytest.approx(held[0]) and held[2] > 0.5, held  # the median fit: [0]'s


async def test_a_queue_is_priced_at_the_median_rate_when_a_fit_is_mostly_base() -> None:
    """A fit whose base took the time (0.15 s and 3 µs a token, against peers' 0.01 s and
    30 µs) prices a 2,000-token prompt dearer than its peers', so a comparison at this
    prompt's length kept it; but the 40,000 tokens the engine reports pending are other
    prompts', and priced at its 3 µs they read 0.12 s where they are 1.2 s of work (its
    peers: 8,000 tokens, 0.24 s). The short prompt then went behind them. Compared by
    ``per_token``, the fit is read as the median's, queue and all."""
    states, ctx, scorer, now = latency_fleet(3, 10_000, decodeSecondsPerRequest=0.0)
    for state in states[:2]:
        _fitted(state, 30e-6)
    base_heavy = states[2]
    _fitted(base_heavy, 3e-6)
    base_heavy.cost.base = 0.15
    busy = base_heavy.metrics = Metrics(
        block_size=16, num_gpu_blocks=10_000, running=2, counts_reported=True,
        prefill_pending_tokens=40_000.0, updated_at=now[0], tick=0.01, heartbeat=0.5,
    )  # fmt: skip
    for idle in states[:2]:
        idle.metrics = Metrics(
            block_size=16, num_gpu_blocks=10_000, running=2, counts_reported=True,
            prefill_pending_tokens=8_000.0, updated_at=now[0], tick=0.01, heartbeat=0.5,
        )  # fmt: skip
    assert busy.prefill_pending_tokens * 3e-6 < 8_000 * 30e-6  # its own rate: the freest
    picked, _, cycle = await schedule(ctx, states, "w" * 8000, scorer)  # 2,000 cold tokens
    assert states[picked] is not base_heavy
    predicted = cycle["latency.predicted"]
    assert predicted[base_heavy.key] - predicted[states[0].key] > 0.8  # 1.2 s against 0.24


def test_no_candidates_predict_nothing() -> None:
    """A cycle whose filters left no endpoint scores none (and does not fail)."""
    _states, _ctx, scorer, _ = latency_fleet(2, 100)
    r = InferenceRequest("r", {}, prompt_text="x", model="m", target_model="m")
    assert scorer.score(CycleState(), r, []) == []
    assert scorer.prefill_seconds(CycleState(), r, []) == 0.0


async def test_a_base_heavy_fit_is_read_as_its_peers_for_a_short_prompt() -> None:
    """A fit whose base took the time (0.15 s and 3 µs a token, against its peers' 6 ms and
    30 µs) holds the waits of short prompts behind long ones' steps, which the wait terms
    count already. Compared at this prompt's length it priced 1,000 tokens at 0.153 s,
    4x its peers, so it was kept, and an idle engine lost a short prompt to busier ones.
    Compared by ``per_token``, under half the median's, it is read as the median."""
    states, ctx, scorer, now = latency_fleet(3, 10_000, decodeSecondsPerRequest=0.0)
    for state in states:
        _fitted(state, PER_TOKEN)
    idle = states[2]
    idle.cost.base, idle.cost.per_token = 0.15, 3e-6
    for busy in states[:2]:
        busy.prefill_busy_until = now[0] + 0.05
    picked, _, cycle = await schedule(ctx, states, "q" * 4000, scorer)  # 1,000 cold tokens
    assert states[picked] is idle
    predicted = cycle["latency.predicted"]
    assert predicted[idle.key] < predicted[states[0].key] - 0.04


async def test_the_work_externality_prices_every_candidate_at_one_cost() -> None:
    """Identical engines whose fits differ (24 µs a token on A, 30 on B), kept apart by a
    tight tolerance. A cold 40,000-token prompt: A has 1 s of prefill queued, B none, so
    B is sooner for this request (2.0 s against 2.7). Priced at each one's own fit, the
    externality charged B for the 0.4 s it computes beyond A, 8 times over (16 picks in
    the last half second, over 2 engines): 3.2 s, and the prompt went behind A's queue.
    Neither holds any of the prompt, so the work the fleet spends is the same on both:
    at one price there is nothing to charge, and B takes it."""
    states, ctx, scorer, now = latency_fleet(
        2, 10_000, decodeSecondsPerRequest=0.0, costTolerance=0.15
    )
    a, b = states
    _fitted(a, 24e-6)
    _fitted(b, 30e-6)
    a.prefill_busy_until = now[0] + 1.0
    scorer._pick_times[:] = [now[0] - 0.01] * 16
    picked, _, cycle = await schedule(ctx, states, "c" * 160_000, scorer)  # 40,000 tokens
    assert states[picked] is b, cycle["latency.predicted"]


async def _giant_after_hits(**params: object) -> tuple[str, dict[str, float]]:
    """Engine H served a group: its first request cold, then 10 hits, one a second. Both
    engines are then idle but for 50 ms of prefill queued on O. A cold 40,000-token
    prompt arrives (~2 s of prefill): "H" or "O", where it went, and the predictions."""
    states, ctx, scorer, now = latency_fleet(2, 10_000, decodeSecondsPerRequest=0.0, **params)
    group = "g" * 8000
    first, _, _ = await schedule(ctx, states, group + " q0", scorer)
    holder, other = states[first], states[1 - first]
    for i in range(1, 11):
        now[0] += 1.0
        picked, _, _ = await schedule(ctx, states, group + f" q{i}", scorer)
        assert states[picked] is holder
    now[0] += 1.0
    other.prefill_busy_until = now[0] + 0.05
    picked, _, cycle = await schedule(ctx, states, "c" * 160_000, scorer)
    return ("H" if states[picked] is holder else "O"), cycle["latency.predicted"]


async def test_a_long_cold_prompt_keeps_off_the_engine_whose_cache_serves_hits() -> None:
    """Placed on H, the cold prompt's ~2 s of prefill would hold up the hits H's cache
    serves (10 in the last minute): each arriving meanwhile waits half of it on average,
    r x work^2 / 2 = 10/60 x 2^2 / 2 = 0.33 s, more than O's 50 ms queue. So it goes to
    O and the group keeps its engine. With the externalities off it takes the sooner
    engine, H (the trace window 927.122 of the shipped trace: a 191k-token prompt went to
    the engine holding a 62k-token prefix that three more requests hit 14-19 s later; they
    waited 5-10 s behind it)."""
    where, predicted = await _giant_after_hits()
    assert where == "O", predicted
    where, predicted = await _giant_after_hits(workExternality=0.0)
    assert where == "H", predicted


async def test_a_long_prompt_is_charged_one_step_for_sharing_a_prefill_in_progress() -> None:
    """The engine schedules its running requests' chunks first, so a prompt admitted while
    another is prefilling shares only that prefill's last step: it delays the other's
    first token by its own tokens in that step, at most ``prefillChunkTokens``. B holds
    the first 20,000 tokens of a 40,000-token prompt and is 0.1 s from the end of
    another prefill; A is idle and cold. On B the prompt costs 0.1 s + 1.2 s, on A 2.0 s
    (with attention). Charged its whole 1.2 s as the delay to B's prefill in progress, B
    looked 2.5 s away and the prefix was computed again on A."""
    states, ctx, scorer, now = _long_fleet(10_000, decodeSecondsPerRequest=0.0)
    _a, b = states
    group = "g" * 80_000  # 20,000 tokens
    await schedule(ctx, [b], group + " q0", scorer)
    now[0] += 60.0  # drained
    b.prefill_busy_until = now[0] + 0.1
    picked, _, cycle = await schedule(ctx, states, group + "c" * 80_000, scorer)
    assert states[picked] is b, cycle["latency.predicted"]


async def test_an_endpoint_without_a_fit_is_predicted_with_its_peers_median() -> None:
    # A new engine still on the prior (50 µs a token) among peers fitted at 30 µs: it is
    # most likely another of them, not 1.7x slower, so it is not starved while it learns.
    states, ctx, scorer, _ = latency_fleet(3, 10_000)
    new = states[2]
    new.cost = PrefillCost()  # the prior, no window yet
    assert new.cost.per_token == PRIOR_PER_TOKEN_S
    for state in states[:2]:
        _fitted(state, PER_TOKEN)
    _, _, cycle = await schedule(ctx, states, "q" * 4000, scorer)
    predicted = cycle["latency.predicted"]
    assert predicted[new.key] == pytest.approx(predicted[states[0].key])


# -- trace-length prompts: the index sees the whole prompt, prefill pays its attention --


def _default_params(type_name: str) -> dict[str, object]:
    """The built-in default profile's parameters for a plugin type."""
    spec = next(p for p in parse_config(DEFAULT_CONFIG_YAML).plugins if p.type == type_name)
    return dict(spec.parameters or {})


def _long_fleet(blocks: int, **latency: object):
    """Two endpoints of ``blocks`` × 16 tokens, the default profile's prefix index, a
    predicted-latency scorer (``latency`` parameters), 4 characters per token."""
    states = fleet(2, blocks=blocks)
    pinned(states)
    ctx = context(states)
    plugin("prefix-cache-scorer", ctx, **_default_params("prefix-cache-scorer"))
    scorer = plugin("predicted-latency-scorer", ctx, **latency)
    now = [100.0]
    scorer.clock = lambda: now[0]
    for _ in range(30):
        ctx.calibration.observe("m", 4000, 1000)
    return states, ctx, scorer, now


async def _place(ctx: PluginContext, state: EndpointState, text: str) -> None:
    """Record ``text``'s blocks on ``state`` as a routed request does."""
    prefix = ctx.extras["prefix_index"]
    r = InferenceRequest("r", {}, prompt_text=text, model="m", target_model="m")
    cycle = CycleState()
    await prefix.prepare(cycle, r, [state])
    prefix.pre_request(cycle, r, SchedulingResult("p", [state]))


async def test_the_default_index_sees_a_shared_prefix_as_long_as_the_prompt() -> None:
    """Traced prompts run to 190k tokens and share prefixes of 10-50k. Engine B holds a
    40,000-token prefix S and engine A only S's first 5,000 tokens, then other text. A
    request S + b finds 40,000 tokens cached on B and 5,000 on A, and goes to B. With
    GIE's 256 index blocks (4,096 tokens at 4 characters a token), both engines matched
    the same first 4,096 tokens, so the hit looked a tenth of its size and equal on both
    (the trace window of docs/benchmarks/routing.md predicted 234k cached tokens where the
    engines had 750k)."""
    states, ctx, scorer, _ = _long_fleet(28_000)
    a, b = states
    shared = "".join(f"{i:07d}|" for i in range(20_000))  # 160,000 characters
    await _place(ctx, b, shared + " a")
    await _place(ctx, a, shared[:20_000] + "x" * 100_000)
    picked, _, cycle = await schedule(ctx, states, shared + " b", scorer)
    cached = cycle["prefix.cached_tokens"]
    assert cached[b.key] == pytest.approx(40_000, rel=0.01)
    assert cached[a.key] == pytest.approx(5_000, rel=0.02)
    assert states[picked] is b


def test_prefill_work_pays_attention_over_the_context() -> None:
    """``a·u·(1 + (c + u/2)/C)`` with ``a = per_token ÷ (1 + m̄/C)``: before any response
    (m̄ = 0) a cold 60,000-token prompt costs twice its straight line at C = 30,000, and a
    hit on 59,000 of its tokens saves ``a·(c + c²/2C)``; once the responses show a mix
    whose mean context is C, the fit's per_token is read as twice ``a``."""
    states, _, scorer, _ = _long_fleet(28_000)
    cost = states[0].cost
    assert scorer.prefill_work(cost, 60_000, 0) == pytest.approx(2 * 60_000 * PER_TOKEN)
    saved = scorer.prefill_work(cost, 60_000, 0) - scorer.prefill_work(cost, 1_000, 59_000)
    assert saved == pytest.approx(PER_TOKEN * (59_000 + 59_000**2 / 60_000))
    response = ResponseInfo(status=200, complete=True, prompt_tokens=60_000, cached_tokens=0)
    request = InferenceRequest("r", {}, prompt_text="x", model="m", target_model="m")
    request.notes["latency.routed_at"] = 100.0
    scorer.response_complete(request, SchedulingResult("p", [states[0]]), response)
    assert scorer.mean_context == pytest.approx(30_000)
    assert scorer.prefill_work(cost, 60_000, 0) == pytest.approx(60_000 * PER_TOKEN)
    linear = plugin("predicted-latency-scorer", context(states), attentionContextTokens=0)
    assert linear.prefill_work(cost, 60_000, 0) == pytest.approx(60_000 * PER_TOKEN)


async def test_a_fit_is_read_at_the_fleets_mix_of_contexts() -> None:
    """Identical engines (``a`` = 30 µs a token at no context): A prefilled 1,000-token
    prompts and fitted 30 µs, B a 60,000-token one and fitted 60 µs, since its tokens
    attended to 30,000 tokens of context on average. Each fit is rescaled from its own
    mix to the fleet's, ``× (1 + m̄/C) ÷ (1 + m(e)/C)``, and they agree within 2 %: an
    idle fleet is a tie. Taken as they were, B looked twice as slow (beyond the
    tolerance), and an idle fleet sent every long prompt to A."""
    states, ctx, scorer, _ = _long_fleet(10_000)
    a, b = states
    _fitted(a, 30e-6 * (1 + 500 / 30_000))
    _fitted(b, 30e-6 * 2)
    for state, tokens in ((a, 1_000), (b, 60_000)):
        response = ResponseInfo(status=200, complete=True, prompt_tokens=tokens, cached_tokens=0)
        request = InferenceRequest("r", {}, prompt_text="x", model="m", target_model="m")
        request.notes["latency.routed_at"] = 100.0
        scorer.response_complete(request, SchedulingResult("p", [state]), response)
    read = [scorer._cost(s).per_token for s in states]
    assert read[0] == pytest.approx(read[1], rel=0.02)
    _, _, cycle = await schedule(ctx, states, "q" * 160_000, scorer)  # 40,000 cold tokens
    predicted = cycle["latency.predicted"]
    assert predicted[a.key] == pytest.approx(predicted[b.key])
    assert scorer.mean_context > 29_000  # the fleet's mix: mostly B's long prompt


async def _long_holder_or_cold(**latency: object) -> str:
    """B holds a 60,000-token prefix and has 2.6 s of prefill queued; A is idle and cold."""
    states, ctx, scorer, now = _long_fleet(10_000, decodeSecondsPerRequest=0.0, **latency)
    _a, b = states
    group = "".join(f"{i:07d}|" for i in range(30_000))  # 240,000 characters
    await schedule(ctx, [b], group + " q0", scorer)
    now[0] += 60.0  # drained
    b.prefill_busy_until = now[0] + 2.6
    picked, _, _ = await schedule(ctx, states, group + " q1", scorer)
    return "AB"[picked]


async def test_a_long_prefix_is_worth_its_attention_to_its_holder() -> None:
    """Recomputing 60,000 tokens on the idle engine costs 60k × 30 µs = 1.8 s on the
    straight line, but 3.6 s with its attention (the simulator's 30 µs a token and 1 ns a
    query-key pair give the same): waiting 2.6 s for the holder is the faster first
    token, and the attention-aware cost waits; the straight line copies the prefix."""
    assert await _long_holder_or_cold() == "B"
    assert await _long_holder_or_cold(attentionContextTokens=0) == "A"


async def _holder_over_the_bound(backlog_s: float, **params: object) -> tuple[bool, bool]:
    """Four endpoints, the first holding a 3,500-token prefix with 9 requests in flight
    against 3, 2 and 1 (over the bound of 5) and ``backlog_s`` of queued prefill; the
    second, equally over the bound, holds nothing. Returns whether the bounded-load
    filter (``params``) keeps the holder, and the non-holder."""
    states, ctx, _scorer, now = latency_fleet(4, 2000, decodeSecondsPerRequest=0.0)
    text = "h" * 14_000 + " q"
    prefix = ctx.extras["prefix_index"]
    holder, busy = states[0], states[1]
    prefix.index.add(holder.key, prefix_hashes(prefix, text))
    for state, load in zip(states, (9, 9, 1, 1), strict=True):
        state.in_flight_requests = load
    holder.prefill_busy_until = now[0] + backlog_s
    bounded = plugin("bounded-load-filter", ctx, loadFactor=1.25, loadSlack=0, **params)
    r = InferenceRequest("r", {}, prompt_text=text, model="m", target_model="m")
    cycle = CycleState()
    await prefix.prepare(cycle, r, states)
    kept = bounded.filter(cycle, r, list(states))
    assert states[2] in kept and states[3] in kept
    return holder in kept, busy in kept


async def test_bounded_load_keeps_a_holder_whose_queue_is_cheaper_than_recomputing() -> None:
    # Recomputing the 3,500-token prefix elsewhere costs ~0.11 s; the holder's queue is
    # 30 ms: kept with keepCheaperHolders, removed by the plain request-count bound.
    assert await _holder_over_the_bound(0.03, keepCheaperHolders=True) == (True, False)
    assert await _holder_over_the_bound(0.03) == (False, False)
    # A queue longer than the recompute: removed either way.
    assert await _holder_over_the_bound(0.5, keepCheaperHolders=True) == (False, False)
