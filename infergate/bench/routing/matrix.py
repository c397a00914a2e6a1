"""The routing lab's workload matrix: cells along the axes a router must hold on.

A preset workload answers one question; a default chosen on one preset is tuned to it.
The matrix instead spans the regimes a fleet meets, and the lab reports each router's
*regret* in every cell (its TTFT p90 and p99 over the best router's there), so a default
is chosen for its worst and mean case rather than its best. The axes:

* ``working_set`` — the hot prefixes' tokens over the fleet's KV capacity
  (``groups × prefix_len ÷ (engines × kv_blocks × block_size)``): at 0.5 every group fits
  somewhere with room to spare; at 2.5 no placement keeps them all cached.
* ``load`` — offered rate over round robin's estimated saturation rate
  (:func:`saturation_rate`): 0.3, 0.6, 0.9 and 1.1 (past it, queues grow for every router).
* ``popularity`` — ``uniform`` groups, or ``zipf`` (group *k* drawn ∝ ``1/(k+1)^1.1``).
* ``mix`` — ``fixed`` (every request: the group prefix, a 32-token question, 48 output
  tokens) or ``mixed`` (questions of 16-800 tokens and 8-192 output tokens, log-uniform).
* ``turns`` — 1, or multi-turn sessions whose history grows every turn.
* ``adapters`` — 0, or that many LoRA adapters (group *g* asks for ``lora-(g mod K)``) on
  engines with 4 adapter slots each.
* ``engines`` — fleet size.

The ``trace`` family (:class:`TraceCell`) adds production-shaped traffic at full scale on
engines with an H100 timing profile: windows of the shipped Mooncake trace, each chosen
by a seed, and *bursty* synthetic traces with the trace's shape — requests in bursts of
6-18 at one instant, heavy-tailed prompt lengths, conversations whose every turn extends
an earlier prompt and system prompts shared across conversations.

Seeds are drawn when the lab runs (``--seed`` fixes one) and recorded with the results.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from infergate.bench.datasets import SampleRequest, Tokens
from infergate.bench.routing import traces
from infergate.bench.routing.workloads import Workload
from infergate.engine.sim_runner import TimingModel

#: The matrix fleet: KV blocks per engine (16 tokens each) and the group prefix length.
KV_BLOCKS = 400
BLOCK_SIZE = 16
PREFIX_TOKENS = 2000
QUESTION_TOKENS = 32
OUTPUT_TOKENS = 48
ZIPF_S = 1.1
ADAPTER_SLOTS = 4
#: Requests per cell: about RUN_SECONDS of arrivals, within these bounds (p99 needs ~100).
RUN_SECONDS = 25.0
MIN_PROMPTS = 120
MAX_PROMPTS = 300

#: The matrix runs the simulator's timing model (engine/sim_runner.py ``TimingModel``)
#: this many times slower, and its rates this many times lower: the same regimes, with
#: half the steps per second, so this 2-core machine keeps the modelled pace (at the
#: normal pace, 4 engines at 35 req/s ran their steps 13-45 % late here).
TIME_SCALE = 2.0
_MODEL = TimingModel()
#: The timing model at that scale, in seconds.
STEP_FLOOR_S = _MODEL.base_ms * 1e-3 * TIME_SCALE
PER_TOKEN_S = _MODEL.us_per_token * 1e-6 * TIME_SCALE
PER_KV_TOKEN_S = _MODEL.us_per_kv_token * 1e-6 * TIME_SCALE
PER_SEQ_S = _MODEL.us_per_seq * 1e-6 * TIME_SCALE
PER_PAIR_S = _MODEL.ns_per_attention_pair * 1e-9 * TIME_SCALE
#: The engine flags that set it.
SIM_ARGS = (
    f"--sim-base-ms={STEP_FLOOR_S * 1e3:g}",
    f"--sim-us-per-token={PER_TOKEN_S * 1e6:g}",
    f"--sim-us-per-kv-token={PER_KV_TOKEN_S * 1e6:g}",
    f"--sim-us-per-seq={PER_SEQ_S * 1e6:g}",
    f"--sim-ns-per-attention-pair={PER_PAIR_S * 1e9:g}",
)


@dataclass(frozen=True)
class Cell:
    working_set: float = 1.0
    load: float = 0.6
    popularity: str = "uniform"
    mix: str = "fixed"
    turns: int = 1
    adapters: int = 0
    engines: int = 4

    @property
    def name(self) -> str:
        parts = [f"ws{self.working_set:g}", f"load{self.load:g}"]
        if self.popularity != "uniform":
            parts.append(self.popularity)
        if self.mix != "fixed":
            parts.append(self.mix)
        if self.turns > 1:
            parts.append(f"turns{self.turns}")
        if self.adapters:
            parts.append(f"lora{self.adapters}")
        if self.engines != 4:
            parts.append(f"{self.engines}e")
        return "-".join(parts)

    @property
    def groups(self) -> int:
        fleet_tokens = self.engines * KV_BLOCKS * BLOCK_SIZE
        return max(2, round(self.working_set * fleet_tokens / PREFIX_TOKENS))


def _prefill_seconds(tokens: float, start: float) -> float:
    """The simulator's compute for ``tokens`` new tokens after ``start`` cached ones."""
    return tokens * PER_TOKEN_S + tokens * (start + tokens / 2) * PER_PAIR_S


def saturation_rate(cell: Cell) -> float:
    """Round robin's saturation rate (req/s) on the cell's fleet, from the timing model.

    Under round robin every engine sees every group, so with LRU caching and uniform
    popularity a prefix is cached with probability ``h = min(1, C ÷ (G × P))`` (C: one
    engine's KV tokens). A request's prefill then costs ``p = (1 − h) × prefill(P + Q) + h ×
    prefill(Q after P)``. Two limits bind at a per-engine rate ``r``:

    * compute: ``r × p < 1``;
    * KV memory: a running request holds ``P + Q + O`` tokens, so at most ``c = C ÷ (P +
      Q + O)`` run at once, each for its prefill plus ``O`` decode steps. The engine spends
      ``u = r × p`` of its time in prefill steps; the rest goes in steps of about the floor
      ``f``, so a sequence advances ``(1 − u) ÷ f + r × (1 − h)`` steps a second and lives
      ``d(r) = p + O ÷ that``. By Little's law the engine holds ``r × d(r)`` requests.

    The saturation rate is the largest ``r`` with ``r × p < 1`` and ``r × d(r) ≤ c``
    (bisection), times the number of engines. Zipf popularity raises ``h`` and a
    mixed-length cell is estimated at its mean lengths, so it is an estimate; round
    robin's rows at load 0.9-1.1 show where it really queues.
    """
    capacity = KV_BLOCKS * BLOCK_SIZE
    question, output = _mean_lengths(cell)
    prefix = PREFIX_TOKENS
    hit = min(1.0, capacity / (cell.groups * prefix))
    prefill = (1 - hit) * _prefill_seconds(prefix + question, 0) + hit * _prefill_seconds(
        question, prefix
    )
    concurrent = capacity / (prefix + question + output)

    def held(rate: float) -> float:
        busy = rate * prefill
        steps_per_second = (1 - busy) / STEP_FLOOR_S + rate * (1 - hit)
        return rate * (prefill + output / steps_per_second)

    low, high = 0.0, 1.0 / prefill
    for _ in range(60):
        mid = (low + high) / 2
        if held(mid) <= concurrent:
            low = mid
        else:
            high = mid
    return cell.engines * low


def _mean_lengths(cell: Cell) -> tuple[float, float]:
    if cell.mix == "mixed":
        return _log_uniform_mean(16, 800), _log_uniform_mean(8, 192)
    return float(QUESTION_TOKENS), float(OUTPUT_TOKENS)


def _log_uniform_mean(low: float, high: float) -> float:
    return (high - low) / math.log(high / low)


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def _group_weights(cell: Cell) -> list[float]:
    if cell.popularity == "zipf":
        return [1.0 / (k + 1) ** ZIPF_S for k in range(cell.groups)]
    if cell.popularity != "uniform":
        raise ValueError(f"popularity must be uniform or zipf, not {cell.popularity!r}")
    return [1.0] * cell.groups


def build_samples(cell: Cell, tokens: Tokens, n: int, seed: int) -> list[SampleRequest]:
    """``n`` requests for the cell: group by popularity, lengths by mix, turns by session."""
    rng = random.Random(seed)
    weights = _group_weights(cell)
    prefixes = [f"System {g}: " + tokens.text(PREFIX_TOKENS, rng) for g in range(cell.groups)]
    histories: dict[int, list[dict[str, str]]] = {}
    samples: list[SampleRequest] = []
    for index in range(n):
        (group,) = rng.choices(range(cell.groups), weights)
        if cell.mix == "mixed":
            question_len, output_len = _log_uniform(rng, 16, 800), _log_uniform(rng, 8, 192)
        else:
            question_len, output_len = QUESTION_TOKENS, OUTPUT_TOKENS
        question = f"Question {index}: " + tokens.text(question_len, rng)
        model = f"lora-{group % cell.adapters}" if cell.adapters else None
        if cell.turns > 1:
            history = histories.get(group)
            if history is None or len(history) >= 2 * cell.turns + 1:
                history = [{"role": "system", "content": prefixes[group]}]
            history.append({"role": "user", "content": question})
            samples.append(
                SampleRequest("", output_len, messages=[dict(m) for m in history], group=group,
                              model=model)
            )  # fmt: skip
            history.append({"role": "assistant", "content": tokens.text(output_len, rng)})
            histories[group] = history
            continue
        samples.append(
            SampleRequest(question, output_len, system=prefixes[group], group=group, model=model)
        )
    return samples


def workload(cell: Cell | TraceCell) -> Workload:
    """The cell as a lab workload: its fleet, its samples and its one rate."""
    if isinstance(cell, TraceCell):
        return cell.workload()

    def build(tokens: Tokens, n: int, seed: int) -> list[SampleRequest]:
        return build_samples(cell, tokens, n, seed)

    rate = round(cell.load * saturation_rate(cell), 1)
    return Workload(
        cell.name,
        f"{cell.groups} groups x {PREFIX_TOKENS} tokens on {cell.engines} engines x "
        f"{KV_BLOCKS} blocks; {cell.load:g} x round robin's saturation",
        build,
        (rate,),
        num_prompts=min(MAX_PROMPTS, max(MIN_PROMPTS, round(rate * RUN_SECONDS))),
        kv_blocks=KV_BLOCKS,
        endpoint="/v1/chat/completions" if cell.turns > 1 else "/v1/completions",
        lora=cell.adapters,
        max_loras=ADAPTER_SLOTS,
        engines=cell.engines,
        engine_args=SIM_ARGS,
    )


#: The shipped trace (``../shared/traces`` beside the repository; its README gives the format).
SHIPPED_TRACE = (
    Path(__file__).resolve().parents[3].parent / "shared/traces/mooncake-synthetic.jsonl"
)
#: Trace cells: seconds of arrivals, the engines' timing profile (full scale).
TRACE_SECONDS = 60.0
TRACE_PROFILE = "h100-llama3.1-8b"
#: Bursty traces: requests per second, burst sizes, and the shape of their prompts. The
#: medians and tails follow the shipped trace's windows (input p50 ~12k tokens, p90
#: ~40k; outputs p50 ~20-170): new text per turn log-normal, median 6,000 tokens; a
#: conversation's next turn carries its whole previous prompt; prompts stop at Llama-3.1's
#: 128k context.
BURST_RATE = 4.0
BURST_SIZES = (6, 18)
NEW_TOKENS_MEDIAN, NEW_TOKENS_SIGMA = 6000.0, 1.0
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_MAX = 80.0, 1.0, 1024
CONTINUE_SHARE = 0.5  # a request continues an earlier conversation
SYSTEM_SHARE = 0.5  # a new conversation starts with one of the shared system prompts
SYSTEM_PROMPTS, SYSTEM_BLOCKS = 8, (2, 8)
CONTEXT_TOKENS = 131072


@dataclass(frozen=True)
class TraceCell:
    """A trace-shaped cell: ``window`` (the shipped trace's window a seed picks) or
    ``bursty`` (a synthetic trace of that seed, :func:`bursty_trace`)."""

    kind: str
    seed: int

    @property
    def name(self) -> str:
        return f"trace-{self.kind}-s{self.seed}"

    def requests(self) -> tuple[list[traces.TraceRequest], traces.Window]:
        if self.kind == "window":
            trace = traces.read_trace(SHIPPED_TRACE)
            return trace, traces.window_for_seed(trace, TRACE_SECONDS, self.seed)
        if self.kind == "bursty":
            return bursty_trace(self.seed), traces.Window(0.0, TRACE_SECONDS, self.seed)
        raise ValueError(f"trace cell kind must be window or bursty, not {self.kind!r}")

    def workload(self) -> Workload:
        trace, window = self.requests()
        return traces.window_workload(self.name, trace, window, traces.Replay(), TRACE_PROFILE)


def _blocks(tokens: int) -> int:
    return max(1, math.ceil(tokens / traces.TRACE_BLOCK_TOKENS))


def bursty_trace(seed: int, seconds: float = TRACE_SECONDS) -> list[traces.TraceRequest]:
    """A synthetic trace in Mooncake's format, shaped like the shipped one but in bursts.

    Bursts come as a Poisson process at ``BURST_RATE ÷ mean burst size`` per second, each
    of ``BURST_SIZES`` requests with one timestamp. A request continues an earlier
    conversation (``CONTINUE_SHARE``: its blocks are that conversation's last prompt
    plus new ones, as a chat turn resends its history) or starts one, half of them behind
    one of ``SYSTEM_PROMPTS`` shared system prompts. New text per request is log-normal
    (heavy-tailed, median ``NEW_TOKENS_MEDIAN``), outputs log-normal; a prompt that would
    pass ``CONTEXT_TOKENS`` starts a new conversation instead."""
    rng = random.Random(seed)
    next_id = [0]

    def fresh(n: int) -> list[int]:
        first = next_id[0]
        next_id[0] += n
        return list(range(first, first + n))

    systems = [fresh(rng.randint(*SYSTEM_BLOCKS)) for _ in range(SYSTEM_PROMPTS)]
    conversations: list[list[int]] = []
    out: list[traces.TraceRequest] = []
    mean_burst = sum(BURST_SIZES) / 2
    t = rng.expovariate(BURST_RATE / mean_burst)
    while t < seconds:
        for _ in range(rng.randint(*BURST_SIZES)):
            new = round(rng.lognormvariate(math.log(NEW_TOKENS_MEDIAN), NEW_TOKENS_SIGMA))
            new = min(max(new, 16), CONTEXT_TOKENS // 2)
            head: list[int] = []
            index = -1
            if conversations and rng.random() < CONTINUE_SHARE:
                index = rng.randrange(len(conversations))
                head = conversations[index]
            elif rng.random() < SYSTEM_SHARE:
                head = rng.choice(systems)
            if (len(head) + _blocks(new)) * traces.TRACE_BLOCK_TOKENS > CONTEXT_TOKENS:
                head, index = [], -1
            ids = head + fresh(_blocks(new))
            length = len(head) * traces.TRACE_BLOCK_TOKENS + new
            length = min(length, len(ids) * traces.TRACE_BLOCK_TOKENS)
            output = round(rng.lognormvariate(math.log(OUTPUT_MEDIAN), OUTPUT_SIGMA))
            out.append(
                traces.TraceRequest(round(t * 1000.0, 3), length, min(max(output, 1), OUTPUT_MAX),
                                    tuple(ids))
            )  # fmt: skip
            if index >= 0:
                conversations[index] = ids
            else:
                conversations.append(ids)
        t += rng.expovariate(BURST_RATE / mean_burst)
    return out


#: Working set × load on 4 engines (uniform popularity, fixed lengths, single turn).
CORE = tuple(
    Cell(working_set=ws, load=load) for ws in (0.5, 1.0, 1.5, 2.5) for load in (0.3, 0.6, 0.9, 1.1)
)
#: Half of CORE in which every working-set and every load level appears twice (each
#: working set at one low and one high load): the part of the matrix a 2-core machine
#: runs for every router in about an hour.
FRACTION = tuple(
    Cell(working_set=ws, load=load)
    for ws, load in ((0.5, 0.3), (0.5, 0.9), (1.0, 0.6), (1.0, 1.1), (1.5, 0.3), (1.5, 0.9),
                     (2.5, 0.6), (2.5, 1.1))
)  # fmt: skip
#: One step along each other axis, from cells of the core.
EXTRA = (
    Cell(working_set=1.5, load=0.9, popularity="zipf"),
    Cell(working_set=2.5, load=0.6, popularity="zipf"),
    Cell(working_set=1.0, load=0.6, mix="mixed"),
    Cell(working_set=1.0, load=0.6, turns=4),
    Cell(working_set=1.0, load=0.6, adapters=8),
    Cell(working_set=1.5, load=0.6, engines=8),
)
#: Production-shaped cells at full scale: three windows of the shipped trace (seeds whose
#: prefix-hit ceilings are about 7 %, 30 % and 52 %) and two bursty synthetic traces.
TRACE = (
    TraceCell("window", 7),
    TraceCell("window", 46),
    TraceCell("window", 2),
    TraceCell("bursty", 1),
    TraceCell("bursty", 2),
)
MATRICES: dict[str, Sequence[Cell | TraceCell]] = {
    "standard": FRACTION + EXTRA,
    "core": CORE,
    "extra": EXTRA,
    "all": CORE + EXTRA,
    "trace": TRACE,
}


def select(matrix: str, only: str | None) -> list[Cell | TraceCell]:
    """The cells of ``matrix`` (``standard``, ``core``, ``extra``, ``all``, ``trace``), or the 0-based indices in
    ``only`` (comma-separated, ranges as ``3-5``) of it, so a long matrix can be run in
    parts on a small machine."""
    if matrix not in MATRICES:
        raise ValueError(f"unknown matrix {matrix!r}: choose from {', '.join(MATRICES)}")
    cells = list(MATRICES[matrix])
    if not only:
        return cells
    chosen: list[Cell | TraceCell] = []
    for part in only.split(","):
        low, _, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValueError(f"--cells: {part!r} is not an index or a range like 3-5") from None
        if not 0 <= first <= last < len(cells):
            raise ValueError(f"--cells: {part!r} is outside 0-{len(cells) - 1}")
        chosen.extend(cells[first : last + 1])
    return chosen
