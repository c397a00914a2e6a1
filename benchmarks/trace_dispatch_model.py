"""An offline queueing model of a trace's dispatch: how far routing alone can move TTFT p90.

The routing lab runs real engines for minutes per router; this model runs a window in a
fraction of a second, to ask what *any* dispatch could reach there (issue 46: the
bursty trace cells, where infergate's p90 stayed near 0.9x sglang-router's).

Each engine is one first-come-first-served prefill server, as the engine's scheduler is
(running requests' chunks first, then the waiting queue in order), with an LRU of the
trace's 512-token blocks as large as the profile's KV cache (a prompt's blocks count as
cached from its placement on; the least recently used go first, a prompt's tail before
its head, as the engine frees them). A request's service time is
the lab profile's prefill of its uncached tokens ``u`` after ``c`` cached ones::

    work(u, c) = step + u·a + u·(c + u/2)·p

``a`` the seconds per token of the weights' FLOPs, ``p`` per causal (query, key) pair,
``step`` one weight-bound decode step (engine/sim_runner.py, ``Profile``). TTFT is the
wait for the engine's queue plus that work. Decode is left out (on the real engine it
shares steps and slows everything a little); so are the EPP's estimates: each policy
below knows every queue and cache exactly.

Policies:

* ``least-work``: each request where its own TTFT is least (the cost model alone).
* ``cost-model``: the same plus the predicted-latency scorer's work externality
  (``n x`` the work beyond the cheapest candidate, docs/epp.md).
* ``sglang-like``: sglang-router's ``cache_aware`` rule: the shortest queue by request
  count when counts are imbalanced (max - min > 32 and max > 1.5 x min); else the
  engine with the longest match when it covers over half the prompt; else the engine
  whose routed-prefix tree is smallest (requests complete after ``DECODE_STEP_S`` per
  output token, for the counts).
* ``hold-release``: requests held in the router while every engine has more than
  ``--hold-seconds`` of prefill queued; when the least-queued engine's queue falls to
  that, the held request with the least ``arrival + --hold-beta x work`` leaves, placed
  by the cost model: reordering that keeps the hits (the EPP's ``flowControl``
  ``maxPrefillQueueSeconds`` and ``prefillOrderWeight``, docs/epp.md).
* ``engine-order``: the cost model's placement, each engine ordering its waiting queue by
  ``arrival + --order-weight x work`` (the EPP's ``x-infergate-order-delay`` under
  ``--scheduling-policy priority``, docs/epp.md). A request already started runs to the
  end; the placement reads each engine's whole queue, as the EPP's clock does.
* ``central-fcfs``: one queue feeding every engine in arrival order, every engine
  holding every block ever sent. Least-work dispatch to FCFS servers is that queue
  (the same start times), so this is least-work with every possible hit: the reference
  for what placement can reach without reordering.
* ``central-sjf``: the same queue served shortest work first: reordering, which no
  dispatch to FCFS engines can do, with its cost in the tail.

    .venv/bin/python benchmarks/trace_dispatch_model.py [--cell trace-bursty-s1 ...]
    .venv/bin/python benchmarks/trace_dispatch_model.py --trace FILE --window 949.329:60
"""

from __future__ import annotations

import argparse
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from infergate.engine.sim_runner import PROFILES, Profile
from rich.console import Console
from rich.table import Table

from infergate.bench.routing import traces
from infergate.bench.routing.matrix import TRACE

#: Seconds per output token of a request decoding on a busy engine (sglang-like counts).
DECODE_STEP_S = 0.02
#: sglang-router ``cache_aware`` defaults: imbalance thresholds and the match share.
BALANCE_ABS, BALANCE_REL, CACHE_THRESHOLD = 32, 1.5, 0.5


def cached_tokens(request: traces.TraceRequest, held: Container[int]) -> int:
    """The prompt tokens in the leading run of ``request``'s blocks that ``held`` has."""
    blocks = 0
    for h in request.hash_ids:
        if h not in held:
            break
        blocks += 1
    return min(blocks * traces.TRACE_BLOCK_TOKENS, request.input_length)


@dataclass
class Fleet:
    """Engines' queues (when each is free), block caches and the sglang-like state."""

    profile: Profile
    engines: int
    free_at: list[float] = field(init=False)
    caches: list[OrderedDict[int, None]] = field(init=False)
    trees: list[set[int]] = field(init=False)
    ends: list[list[float]] = field(init=False)

    def __post_init__(self) -> None:
        self.free_at = [0.0] * self.engines
        self.caches = [OrderedDict() for _ in range(self.engines)]
        self.trees = [set() for _ in range(self.engines)]
        self.ends = [[] for _ in range(self.engines)]
        self.capacity = self.profile.kv_tokens() // traces.TRACE_BLOCK_TOKENS

    def work(self, uncached: float, cached: float) -> float:
        p = self.profile
        attention = uncached * (cached + uncached / 2.0) * p.attention_s_per_pair
        return p.weights_s + uncached * p.prefill_s_per_token + attention

    def cached(self, e: int, request: traces.TraceRequest) -> int:
        return cached_tokens(request, self.caches[e])

    def place(self, e: int, request: traces.TraceRequest, now: float, work: float) -> float:
        """Queue ``request`` on engine ``e``; its TTFT."""
        start = max(now, self.free_at[e])
        self.free_at[e] = start + work
        self.ends[e].append(self.free_at[e] + request.output_length * DECODE_STEP_S)
        self.trees[e].update(request.hash_ids)
        cache = self.caches[e]
        for h in reversed(request.hash_ids):  # the head last: an engine evicts tails first
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > self.capacity:
            cache.popitem(last=False)
        return self.free_at[e] - now


@dataclass
class Candidate:
    engine: int
    wait: float
    work: float
    cached: int


Policy = Callable[[Fleet, list[Candidate], traces.TraceRequest, float, list[float]], int]


def least_work(fleet: Fleet, cands: list[Candidate], r: traces.TraceRequest, now: float,
               picks: list[float]) -> int:  # fmt: skip
    return min(cands, key=lambda c: c.wait + c.work).engine


def cost_model(fleet: Fleet, cands: list[Candidate], r: traces.TraceRequest, now: float,
               picks: list[float]) -> int:  # fmt: skip
    """Own TTFT + ``n x (work - least work)``, ``n`` the picks of the last mean-wait
    seconds per engine (docs/epp.md, the work externality)."""
    backlog = sum(c.wait for c in cands) / len(cands)
    behind = sum(1 for t in picks if t >= now - backlog) / len(cands) if backlog > 0 else 0.0
    least = min(c.work for c in cands)
    return min(cands, key=lambda c: c.wait + c.work + behind * (c.work - least)).engine


def sglang_like(fleet: Fleet, cands: list[Candidate], r: traces.TraceRequest, now: float,
                picks: list[float]) -> int:  # fmt: skip
    fleet.ends = [[t for t in ends if t > now] for ends in fleet.ends]
    load = [len(ends) for ends in fleet.ends]
    if max(load) - min(load) > BALANCE_ABS and max(load) > BALANCE_REL * min(load):
        return min(range(fleet.engines), key=load.__getitem__)
    best = max(cands, key=lambda c: c.cached)
    if best.cached > CACHE_THRESHOLD * r.input_length:
        return best.engine
    return min(range(fleet.engines), key=lambda e: len(fleet.trees[e]))


def candidates(fleet: Fleet, r: traces.TraceRequest, now: float) -> list[Candidate]:
    """Every engine's wait, work and cached tokens for ``r`` at ``now``."""
    out = []
    for e in range(fleet.engines):
        cached = fleet.cached(e, r)
        uncached = max(1, r.input_length - cached)
        out.append(Candidate(e, max(0.0, fleet.free_at[e] - now),
                             fleet.work(uncached, cached), cached))  # fmt: skip
    return out


def dispatch(requests: Sequence[traces.TraceRequest], policy: Policy, profile: Profile,
             engines: int) -> tuple[list[float], float]:  # fmt: skip
    """Each request's TTFT under ``policy``, and the hit fraction of prompt tokens."""
    fleet = Fleet(profile, engines)
    ttfts: list[float] = []
    picks: list[float] = []
    hit = 0
    for r in requests:
        now = r.timestamp_ms / 1000.0
        cands = candidates(fleet, r, now)
        chosen = cands[policy(fleet, cands, r, now, picks)]
        ttfts.append(fleet.place(chosen.engine, r, now, chosen.work))
        picks.append(now)
        hit += chosen.cached
    return ttfts, hit / max(1, sum(r.input_length for r in requests))


def hold_release(requests: Sequence[traces.TraceRequest], profile: Profile, engines: int,
                 hold_s: float, beta: float) -> tuple[list[float], float]:  # fmt: skip
    """Requests held in the router while every engine has more than ``hold_s`` seconds of
    prefill queued; whenever the least-queued engine's queue falls to ``hold_s``, the held
    request with the least ``arrival + beta x work`` (its work on its cheapest engine)
    leaves, placed by the cost model. Reordering that keeps the hits: the engine is still
    chosen per request, with its cache, at release."""
    fleet = Fleet(profile, engines)
    held: list[traces.TraceRequest] = []
    ttfts: list[float] = []
    picks: list[float] = []
    hit, i = 0, 0

    def release(now: float) -> None:
        nonlocal hit
        options = [(r, candidates(fleet, r, now)) for r in held]
        r, cands = min(options, key=lambda o: o[0].timestamp_ms / 1000.0
                       + beta * min(c.work for c in o[1]))  # fmt: skip
        held.remove(r)
        chosen = cands[cost_model(fleet, cands, r, now, picks)]
        fleet.place(chosen.engine, r, now, chosen.work)
        ttfts.append(fleet.free_at[chosen.engine] - r.timestamp_ms / 1000.0)
        picks.append(now)
        hit += chosen.cached

    while i < len(requests) or held:
        due = min(fleet.free_at) - hold_s  # when the least-queued engine reaches hold_s
        if held and (i == len(requests) or due <= requests[i].timestamp_ms / 1000.0):
            release(due)
            continue
        now = requests[i].timestamp_ms / 1000.0
        held.append(requests[i])
        i += 1
        while held and min(fleet.free_at) - now <= hold_s:
            release(now)
    return ttfts, hit / max(1, sum(r.input_length for r in requests))


def engine_order(requests: Sequence[traces.TraceRequest], profile: Profile, engines: int,
                 beta: float) -> tuple[list[float], float]:  # fmt: skip
    """The cost model's placement; each engine serves its waiting requests by the least
    ``arrival + beta x work`` (not started ones only: no preemption)."""
    fleet = Fleet(profile, engines)
    queues: list[list[tuple[float, int, float, float]]] = [[] for _ in range(engines)]
    busy = [0.0] * engines  # when each engine's started request ends
    ttfts: list[float] = [0.0] * len(requests)
    picks: list[float] = []
    hit = 0

    def advance(e: int, now: float) -> None:
        while queues[e] and busy[e] <= now:
            _, i, arrival, work = heapq.heappop(queues[e])
            busy[e] = max(busy[e], arrival) + work
            ttfts[i] = busy[e] - arrival

    for i, r in enumerate(requests):
        now = r.timestamp_ms / 1000.0
        for e in range(engines):
            advance(e, now)
            fleet.free_at[e] = max(busy[e], now) + sum(q[3] for q in queues[e])
        cands = candidates(fleet, r, now)
        chosen = cands[cost_model(fleet, cands, r, now, picks)]
        fleet.place(chosen.engine, r, now, chosen.work)  # its cache; free_at is rebuilt
        heapq.heappush(queues[chosen.engine], (now + beta * chosen.work, i, now, chosen.work))
        picks.append(now)
        hit += chosen.cached
    for e in range(engines):
        advance(e, float("inf"))
    return ttfts, hit / max(1, sum(r.input_length for r in requests))


def central(requests: Sequence[traces.TraceRequest], profile: Profile, engines: int,
            shortest_first: bool) -> tuple[list[float], float]:  # fmt: skip
    """One queue over every engine, every block ever sent cached everywhere."""
    fleet, seen, jobs = Fleet(profile, engines), set[int](), []
    hit = 0
    for r in requests:
        cached = cached_tokens(r, seen)
        seen.update(r.hash_ids)
        hit += cached
        jobs.append((r.timestamp_ms / 1000.0, fleet.work(max(1, r.input_length - cached), cached)))
    free, order, ttfts, i = [0.0] * engines, itertools.count(), [], 0
    queue: list[tuple[float, int, float, float]] = []
    while i < len(jobs) or queue:
        e = min(range(engines), key=free.__getitem__)
        while i < len(jobs) and (jobs[i][0] <= free[e] or not queue):
            arrival, work = jobs[i]
            heapq.heappush(queue, (work if shortest_first else arrival, next(order), arrival, work))
            i += 1
        _, _, arrival, work = heapq.heappop(queue)
        free[e] = max(free[e], arrival) + work
        ttfts.append(free[e] - arrival)
    return ttfts, hit / max(1, sum(r.input_length for r in requests))


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def windows(args: argparse.Namespace) -> list[tuple[str, list[traces.TraceRequest]]]:
    """The windows to model: ``--trace``'s ``--window``s, then the ``--cell``s (every trace
    cell when neither is given)."""
    out = []
    if args.trace:
        if not args.window:
            raise SystemExit("--trace needs at least one --window START:SECONDS")
        try:
            trace = traces.read_trace(Path(args.trace))
            chosen = traces.parse_windows(args.window)
        except (traces.TraceError, ValueError) as error:
            raise SystemExit(str(error)) from None
        for window in chosen:
            requests = traces.in_window(trace, window)
            if not requests:
                raise SystemExit(f"no request of {args.trace} falls in {window.label}")
            out.append((f"{Path(args.trace).stem}@{window.label}", requests))
    cells = {cell.name: cell for cell in TRACE}
    names = args.cell if args.cell or args.trace else list(cells)
    for name in names or []:
        if name not in cells:
            raise SystemExit(f"unknown cell {name!r}: one of {', '.join(cells)}")
        trace, window = cells[name].requests()
        out.append((name, traces.in_window(trace, window)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cell", action="append", help="a --matrix trace cell (all by default)")
    parser.add_argument("--trace", help="a Mooncake-format trace, with --window")
    parser.add_argument("--window", action="append", help="START:SECONDS of --trace")
    parser.add_argument("--engines", type=int, default=4, help="engines in the fleet (>= 1)")
    parser.add_argument("--hold-seconds", type=float, default=0.5,
                        help="hold-release: engines' queued prefill (s) below which one may take more")  # fmt: skip
    parser.add_argument("--hold-beta", type=float, default=1.0,
                        help="hold-release: seconds of precedence given up per second of work")  # fmt: skip
    parser.add_argument("--order-weight", type=float, default=2.0,
                        help="engine-order: seconds of precedence given up per second of work")  # fmt: skip
    parser.add_argument("--profile", default="h100-llama3.1-8b", choices=sorted(PROFILES))
    args = parser.parse_args()
    if args.engines < 1:
        parser.error("--engines must be at least 1")
    if args.hold_seconds < 0 or args.hold_beta < 0 or args.order_weight < 0:
        parser.error("--hold-seconds, --hold-beta and --order-weight must be >= 0")
    profile = PROFILES[args.profile]
    policies: dict[str, Callable[[Sequence[traces.TraceRequest]], tuple[list[float], float]]] = {
        "least-work": lambda rs: dispatch(rs, least_work, profile, args.engines),
        "cost-model": lambda rs: dispatch(rs, cost_model, profile, args.engines),
        "sglang-like": lambda rs: dispatch(rs, sglang_like, profile, args.engines),
        "hold-release": lambda rs: hold_release(
            rs, profile, args.engines, args.hold_seconds, args.hold_beta
        ),
        "engine-order": lambda rs: engine_order(rs, profile, args.engines, args.order_weight),
        "central-fcfs": lambda rs: central(rs, profile, args.engines, False),
        "central-sjf": lambda rs: central(rs, profile, args.engines, True),
    }
    table = Table(title=f"dispatch model, {args.engines} x {args.profile} (TTFT in s)")
    for column in ("window", "policy", "p50", "p90", "p99", "hit", "p90 / p99 ÷ sglang-like"):
        table.add_column(column, justify="left" if column in ("window", "policy") else "right")
    for name, requests in windows(args):
        rows = {policy: run(requests) for policy, run in policies.items()}
        ref = rows["sglang-like"][0]
        for policy, (ttfts, hit) in rows.items():
            p90, p99 = quantile(ttfts, 0.9), quantile(ttfts, 0.99)
            ratio = f"{p90 / quantile(ref, 0.9):.2f} / {p99 / quantile(ref, 0.99):.2f}"
            table.add_row(f"{name} ({len(requests)})", policy, f"{quantile(ttfts, 0.5):.2f}",
                          f"{p90:.2f}", f"{p99:.2f}", f"{100 * hit:.1f}%", ratio)  # fmt: skip
        table.add_section()
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
