"""Predicted-latency scoring: send each request where its first token comes soonest.

For every candidate endpoint ``e`` the scorer predicts this request's time to first
token there (all times in seconds)::

    ttft(e) = max(wait(e), queue(e)) + base(e) + work(e) + evict(e)
              + copy(e) + interfere(e) + busy(e) + later(e) + block(e)

* ``work(e) = per_token(e) × uncached × (1 + (cached + uncached/2)/C) ÷ (1 + m̄/C)``: the
  prefill of the uncached tokens with their attention over the context
  (:meth:`PredictedLatencyScorer.prefill_work` derives it; ``C`` is
  ``attentionContextTokens``, 0 for a straight line ``per_token × uncached``).

* ``uncached(e) = prompt_tokens − cached(e)``: ``prompt_tokens`` is the prompt's length
  in characters over the learned characters-per-token; ``cached(e)`` is what the prefix
  index (``prefix-cache-scorer``, calibrated by the engines) predicts ``e`` holds. When
  ``precise-prefix-cache-scorer`` runs too (engines publishing KV events), its exact
  token count and the larger of the two cached estimates are used: events are the truth
  once they arrive, the approximate index covers the window before they do.
* ``base(e)``, ``per_token(e)``: the endpoint's own prefill cost, fitted online from its
  ``vllm:request_prefill_time_seconds`` and prompt/hit token counters
  (:mod:`infergate.epp.prefill_cost`) — a slow engine learns a large
  ``per_token``, read at the fleet's mix of contexts (:meth:`PredictedLatencyScorer._cost`).
  Compared across the candidates, a fit is read as the candidates' median fit ``m``
  (the lower median by ``per_token``) when it is within the fits' noise of it
  (``costTolerance``, τ): ``cost(e) = m`` if ``|pt(e) − pt(m)| ≤ τ · pt(m)``, and always
  for an endpoint with no fitted window yet (its prior is a guess; its peers' fits are
  evidence). Why: on an idle fleet the cheapest-looking engine won every tie, so it took
  2× the requests of another (imbalance 1.24-1.33 on the routing lab's no-sharing
  workload), and on traces whose prompts run from 1k to 80k tokens the fits of
  identical engines spread 30 % from their median in half the decisions and 73 % in a
  tenth (a slice of Mooncake's arxiv trace); an engine really slower than τ keeps its
  own cost. ``per_token`` decides, not the seconds for this prompt: the fit's two
  parameters trade against each other (an engine that admits a short prompt while a
  long one fills its steps reports the wait as the short one's prefill), and a fit
  whose base took the time (0.13 s and 12 µs a token, against its peers' 0.01 s and 44
  µs) priced a short prompt about right but a queue of other prompts' tokens, and any
  long prompt, at a quarter of their cost. A fit *cheaper* than half the median
  (:data:`CHEAP_FIT_SHARE`) is read as the median too, and the clock below advances by
  the median for it. Why: on windows of prompts from 1k to 120k tokens the base took all
  the time and ``per_token`` fell to 0. That
  engine then looked able to prefill 79k tokens in 0.2 s, took every long prompt of the
  next seconds, and its clock, advanced by that cheap work, showed no queue: one engine
  of four queued 10-20 s (a slice of Mooncake's arxiv trace, TTFT p90 1.8x
  sglang-router's). A too-dear fit only steers work away from its engine, so the rule is
  one-sided; a fleet whose engines really differ 2x in speed keeps the slow ones' fits.
  Otherwise the prefill clock advances by the endpoint's own fit: it tracks that engine.
* ``wait(e)``: prefill work already queued there. The EPP keeps a virtual clock per
  endpoint: routing a request adds its ``work`` seconds, and the work
  drains at one second per second (an engine works through its prefills at its own pace),
  so ``wait = max(0, busy_until − now)``. Two floors cover work that did not come through
  this EPP (another replica's, or a client's sent around it): the engine's reported waiting
  queue, ``waiting × base``, and, from an engine that pushes load reports, its pending
  prefill, ``max(0, pending × per_token − age) + sent × per_token``: ``pending`` its
  running requests' prompt tokens not yet computed at its last report and its waiting
  requests' tokens that were not cached when they arrived, ``age`` the
  report's age (the engine has worked that long since), ``sent`` the uncached tokens this
  EPP routed there after it.
  With one replica the clock and the report agree; with several, only the report sees the
  prefill another replica started, which would otherwise look like an idle engine.
* ``evict(e)``: what loading this prompt will cost *later*. If the uncached tokens do
  not fit in the part of ``e``'s KV cache the index believes free, the overflow evicts
  other prefixes that will have to be recomputed: ``overflow_tokens × per_token ×
  evictionPenalty × reuse``. ``reuse`` is the fleet's recent prefix-hit fraction
  (cached ÷ prompt tokens over the responses this EPP saw complete, token-weighted and
  decayed, starting from ``REUSE_PRIOR_RESPONSES`` full hits the size of the first
  response: a fleet's first responses are its compulsory misses, and without the prior
  they made every copy and eviction look free while the groups were being placed): the
  chance that an evicted token would have been read again. When the hot
  prefixes fit, it is high and evicting a group costs nearly its recompute; when they
  cannot all fit (a working set larger than the fleet's caches), most evicted blocks would
  have been evicted unread anyway, and charging them in full would make every holder far
  too sticky. This keeps prefix groups from being scattered over every cache (which
  is what makes a tight-capacity fleet thrash) while still letting a group move when its
  holder's queue costs more than recomputing it elsewhere.
* ``copy(e)``: what copying a prefix that another endpoint holds costs the fleet. The
  eviction term charges only what overflows ``e``'s free cache, so while caches have
  room a second copy of a group looks free; but the copy takes room the next new group
  will need, and on a fleet whose hot prefixes just fit (the routing lab's
  tight-prefix: 12 groups, room for 3 per engine) one copy made while its holder was
  busy for a few ms put a fourth group on an engine that holds three, which then
  thrashed for the rest of the run. So ``copy(e) = copied × per_token ×
  duplicationPenalty × reuse × fullness``: ``copied`` the tokens of the prompt another
  endpoint holds beyond what ``e`` holds, less the overflow already charged above;
  ``fullness`` the candidates' index occupancy (Σ held ÷ Σ capacity, in index blocks),
  so a copy is nearly free on empty caches and costs its recompute on full ones. A hot
  group still spreads: once its holder's queue costs more than one recompute, a copy is
  the faster choice.
* ``queue(e)``: the wait for room on the engine itself. An engine admits a request only
  when its KV cache has room for it (and it runs at most ``max_num_seqs``), so behind a
  full cache a request waits for running requests to *finish*, which takes decode time the
  prefill clock above knows nothing of. With ``n`` requests on ``e`` (the larger of the
  EPP's in-flight count and the engine's running + waiting) and ``T(e)`` the mean time
  from routing to completion the EPP observed there, Little's law gives ``e``'s
  completion rate ``X = n ÷ T``; the request waits for the ``waiting(e)`` requests ahead
  of it plus the ``k`` completions that free enough cache for it: ``k = ⌈(need − free) ÷
  held⌉`` where ``free = capacity × (1 − kv_usage)``, ``held`` the mean tokens a running
  request holds, and ``need = max(uncached, prompt − shared) + max_tokens``: ``shared``
  the prefix it shares with a request this EPP has in flight on ``e``
  (:class:`RunningPrefixes`). A hit on blocks no running request references needs
  their room too: the engine counts them free (``kv_usage`` leaves them out) and takes
  them out of the free blocks when it admits the hit. Counting only the uncached part,
  a hit on a full engine looked admissible at once and waited there for a running
  request to finish (the routing lab's KV-bound cells, where 3 requests fill an
  engine). So ``queue(e) = (waiting(e) + k) ÷ X``. This is what makes a sticky engine with a full
  cache lose to a cold idle one once the queue costs more than the prefill it saves.
* ``interfere(e) = min(work(e), prefillChunkTokens × per_token) × interferencePenalty``
  while ``e`` is still prefilling another request (its clock or its report shows
  prefill work left), else 0: the delay this request adds to *that* request's first
  token. An engine schedules its running requests' chunks first and fills what is left of
  each step's token budget with new ones, so a second prompt shares the first one's last
  step and lengthens it by its own tokens there, at most one step's budget. A long prompt
  is not charged its whole prefill for it: charged so, a 72,852-token prompt was
  predicted 6.4 s later on an engine 0.26 s from the end of another prefill (a slice of
  Mooncake's arxiv trace). Predicting only the new request's own TTFT misses the delay:
  two cold prompts ~100 ms apart on one engine of eight (the 8-engine cell of the
  routing lab's matrix) gave the first one twice a cold prefill, which was that cell's
  1 % tail. A hit's few uncached tokens cost nearly nothing here, so stickiness is
  unchanged; a cold prompt goes to an engine that is not prefilling when there is one.
* ``busy(e) = running(e) × decodeSecondsPerRequest``: a small tie-break for decode load.
* ``later(e)``, the *work externality*: what this choice costs the requests that come
  after it. Prefill work spent here beyond the cheapest candidate's (recomputing a
  prefix its holder would have hit) sits in an engine's queue ahead of every request
  that reaches that engine before the queue drains, and routing that balances the queues
  spreads the delay over the fleet: each of the ``λ·w̄`` requests arriving in the next
  ``w̄`` seconds (``w̄`` the candidates' mean ``max(wait, queue)``, ``λ`` the arrival
  rate) waits ``extra ÷ N`` longer (``N`` candidates). By Little's law that is the
  number queued per engine, ``n = λ·w̄ ÷ N``, measured as this EPP's picks over the last
  ``w̄`` seconds ÷ ``N``. So ``later(e) = workExternality × n × (work(e) − min_e'
  work(e'))``, every ``work`` here at the candidates' median fit: what differs between
  them is the prefix each holds, not the fits' noise (a lower bound: it leaves out that
  the delayed requests extend the busy period in turn, the ``1 ÷ (1 − ρ)`` of an M/G/1
  queue). On an idle fleet ``n`` is 0
  and each request takes the sooner engine; in a backlog a request stays on the holder
  of its prefix until the holder's queue is longer than ``(1 + n)`` recomputes. Without
  it, a bursty trace window at 40-50 % of its hit ceiling (queues of seconds) recomputed
  11 % of the blocks it could have hit, to save each request its own wait, and every
  request behind paid for it.
* ``block(e)``, *holding up a holder*: the same price for the delay this request's own
  prefill adds to the hits ``e``'s cache is about to serve. They arrive at ``r(e)``, this
  EPP's picks over the last :data:`HIT_RATE_WINDOW_S` that found at least
  :data:`HIT_SHARE` of their prompt on ``e``; the ``r(e) × work(e)`` of them arriving
  during the prefill wait half of it each on average. So ``block(e) = workExternality ×
  r(e) × work(e)² ÷ 2`` (``work`` at the candidates' median fit, as in ``later``). It
  is what tells apart engines of equal work and near-equal wait, where ``later`` is 0: a
  hit's own prefill is short, and a cold prompt of 0.125 s (the routing lab's matrix) on
  an engine hit 5 times a second adds 40 ms, but a 191k-token one (25 s) adds minutes. Without it, in a window of
  the shipped trace (927.122:60) that prompt went to the engine 0.15 s sooner, which
  held a 62k-token prefix; the three requests that hit it 14-19 s later waited 5-10 s
  behind it, and the window's p90 was 0.87-0.94x sglang-router's (0.60 with it).
* ``progress(e)``, an *in-progress hit*: the part of ``cached(e)`` that a pick of the same
  instant (the last ``SAME_STEP_S``) placed on ``e`` is not in the engine's cache yet.
  Both requests wait for the engine's next step; it admits this one at the latest in the
  step of that prefill's last chunk and it hits only the blocks computed before it, so it
  computes up to one step's budget of them again, beside that prefill:
  ``progress(e) = (1 + interferencePenalty) × per_token × min(pending, prefillChunkTokens)``.
  Without it a burst of one new prefix all went to the first engine that got it (its
  hit looked free, and the holder's queue grew by one token per request): 7 of 8 on one
  engine of four; with it, copies where the engine would really compute the prefix twice.

**Burst accounting.** Requests that arrive together are placed one after another, and
the engine's counts show a request only once it has reached the engine and the engine
has reported since. So every pick records at once, on its endpoint, a *claim*
(:class:`~infergate.epp.types.Claim`): its prefill (the clock above, and
``claimed_prefill_tokens`` for the pending-prefill floor), its KV tokens (uncached prompt
+ output budget, for ``queue``), its batch slot and its prompt blocks (for ``progress``);
the prefix index records the blocks as held there at the same moment. The N-th request of
a burst thus sees the N-1 placed before it. A claim ends when a report sampled at least
``REACH_S`` after the pick shows it, or when its request ends, whichever is first. Cost:
one small object per pick, O(1) to add and release, and a scan of the endpoint's
unreported claims only for an endpoint this request hits while it has any.
* An endpoint whose metrics are stale (DESIGN.md: stale means saturated; a dead engine
  stops answering its scrapes) gets ``STALE_PENALTY_S`` added, so it is chosen only when
  every candidate is stale.

The score is ``min_e ttft(e) / ttft(e)``, in (0, 1]: the fastest endpoint scores 1.

**The engine's order.** Placement cannot reorder an engine's FIFO queue: in a burst a 2 s
prefill placed first holds up the 50 ms ones behind it wherever they go. So the picked
request carries ``x-infergate-order-delay: β × work(e)`` (β: ``engineOrderWeight``), and
an engine under ``--scheduling-policy priority`` orders its waiting queue, within a
priority, by ``arrival + β × work``: a prefill of ``w`` seconds overtakes any longer one
``W`` that arrived less than ``β (W − w)`` before it. Aging is built in, so a long prompt
waits at most ``β × its own work`` behind later arrivals. An fcfs engine ignores the
header. Why β = 2: in ``benchmarks/trace_dispatch_model.py`` (``--order-weight``) it moved
TTFT p90 of the bursty trace cells from 0.92× to 0.75× and 0.81× the sglang-like rule's
(p99 0.84×, 0.96×) and left quiet windows as they were; larger β gained little more at
p90 and lost p99.

Why this does not starve a hot group: every request routed to the holder adds its own
uncached work to the holder's clock, so once the holder's queue is longer than the
recompute a second endpoint would need, the second endpoint *is* the predicted-faster
choice and the group spreads; the eviction term makes that second endpoint the one with
the most room. References read: NVIDIA Dynamo's KV router (overlap blocks against decode
load) and GIE's latency-predictor proposal; the model here is a deliberately simple
linear one whose parameters are learned per endpoint.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import math
import time
from collections.abc import Sequence
from typing import Any

from infergate.epp.framework.requestcontrol import (
    PrefillEstimate,
    PreRequest,
    ResponseComplete,
    ResponseInfo,
)
from infergate.epp.prefill_cost import PrefillCost
from infergate.epp.scheduling.plugins.base import PluginContext, SchedulingResult, Scorer, register
from infergate.epp.scheduling.plugins.filters import LATENCY_MODEL, endpoint_load
from infergate.epp.types import Claim, CycleState, EndpointState, InferenceRequest
from pydantic import BaseModel, ConfigDict, Field

from infergate.wire.names import MAX_ORDER_DELAY_S, ORDER_DELAY_HEADER

#: Added to the prediction of an endpoint with stale metrics (seconds).
STALE_PENALTY_S = 60.0
#: Before the first completion on an endpoint: seconds per output token (decode step).
PRIOR_DECODE_STEP_S = 0.01
#: Output tokens assumed for a request without ``max_tokens``.
DEFAULT_OUTPUT_TOKENS = 128
#: Weight of the newest observed request lifetime in its moving average.
LIFETIME_EWMA = 0.1
#: Decay per response of the prefix-hit fraction behind the eviction charge (~200 responses).
REUSE_DECAY = 0.005
#: Decay per response of an endpoint's own mix (:meth:`PredictedLatencyScorer._cost`): its
#: fit's ``forget``, 0.99 per finished request.
ENDPOINT_MIX_DECAY = 0.01
#: Responses' worth of full hits the prefix-hit fraction starts from (module docstring).
REUSE_PRIOR_RESPONSES = 8.0
#: Request note holding the (endpoint, :class:`Claim`) of a pick until the request ends.
CLAIM_NOTE = "latency.claim"
#: Picks this recent (seconds) have not reached their engine's next step: a request placed
#: now on the same engine joins that step (in-progress hits, module docstring).
SAME_STEP_S = 0.005
#: Request note holding the (endpoint key, block hashes, sampled ones) of a request in flight.
RUNNING_NOTE = "latency.running"
#: Of an in-flight prompt's index blocks, every this-many-th (and its last) is remembered,
#: to find the prefix a new prompt shares with the requests on an endpoint
#: (:class:`RunningPrefixes`).
SHARED_STRIDE = 8
#: A fit whose prefill of the prompt is under this share of the candidates' median is
#: read as the median (module docstring, ``base(e)``).
CHEAP_FIT_SHARE = 0.5
#: Picks remembered for the work externality's count of recent arrivals (at least this
#: many, at most twice as many).
PICK_HISTORY = 4096
#: A pick counts as a hit on its endpoint's cache (for ``block(e)``) when the endpoint
#: held at least this share of the prompt.
HIT_SHARE = 0.5
#: The window (seconds) over which an endpoint's rate of hits is counted (``block(e)``).
HIT_RATE_WINDOW_S = 60.0
#: Hit picks remembered per endpoint for that rate (a faster one reads as this many a
#: window).
HIT_HISTORY = 1024


class RunningPrefixes:
    """The prompt prefixes of this EPP's requests in flight, per endpoint.

    What a request adds to an engine's KV usage is its prompt less the prefix it shares
    with a request *running* there, plus its output: vLLM counts cached blocks that no
    running request references as free (``kv_cache_usage`` leaves them out), and a hit
    on them takes them out of the free blocks at admission (``allocate_slots`` counts
    them as evictable computed blocks). Only blocks a running request references cost
    nothing more. So a prompt that hits a prefix left by a finished request needs its
    whole length of free cache, not its uncached part (module docstring, ``queue``).

    The block hashes chain, so sharing block ``j`` means sharing every block before it.
    Each endpoint maps the hashes at its in-flight prompts' sampled positions (every
    :data:`SHARED_STRIDE`-th block from the first, and each prompt's last) to how many
    prompts have them and the newest such prompt. The longest shared prefix is found by
    a binary search over the sampled positions, one dict lookup each, then block by
    block against that newest prompt up to the next sampled position (a lower bound when
    that prompt has ended). Cost: ``blocks ÷ SHARED_STRIDE`` dict updates when a request
    is routed and again when it ends; ``O(log blocks + SHARED_STRIDE)`` lookups per
    candidate holding anything."""

    def __init__(self) -> None:
        #: endpoint key -> sampled hash -> [prompts in flight with it, the newest one].
        self._held: dict[str, dict[bytes, list[Any]]] = {}

    @staticmethod
    def sample(hashes: bytes) -> list[bytes]:
        """The hashes at the sampled positions of a packed prompt (8 bytes a block)."""
        n = len(hashes) // 8
        at = list(range(0, n, SHARED_STRIDE))
        if n and at[-1] != n - 1:
            at.append(n - 1)
        return [hashes[8 * j : 8 * j + 8] for j in at]

    def add(self, key: str, hashes: bytes, sampled: list[bytes]) -> None:
        held = self._held.setdefault(key, {})
        for h in sampled:
            entry = held.get(h)
            if entry is None:
                held[h] = [1, hashes]
            else:
                entry[0] += 1
                entry[1] = hashes

    def remove(self, key: str, hashes: bytes, sampled: list[bytes]) -> None:
        held = self._held.get(key)
        if held is None:
            return
        for h in sampled:
            entry = held.get(h)
            if entry is None:
                continue
            entry[0] -= 1
            if entry[0] <= 0:
                del held[h]
            elif entry[1] is hashes:
                entry[1] = None  # another prompt has it; which is not known
        if not held:
            del self._held[key]

    def shared_blocks(self, key: str, hashes: bytes) -> int:
        """Leading blocks of ``hashes`` that a request in flight on ``key`` also has
        (never more than one really shares)."""
        held = self._held.get(key)
        n = len(hashes) // 8
        if not held or n == 0:
            return 0
        if hashes[8 * (n - 1) : 8 * n] in held:
            return n
        low, high = -1, (n - 1) // SHARED_STRIDE  # the last sampled position held, in strides
        while low < high:
            mid = (low + high + 1) // 2
            j = mid * SHARED_STRIDE
            if hashes[8 * j : 8 * j + 8] in held:
                low = mid
            else:
                high = mid - 1
        if low < 0:
            return 0
        j = low * SHARED_STRIDE
        newest: bytes | None = held[hashes[8 * j : 8 * j + 8]][1]
        j += 1
        if newest is not None:
            end = min(n, len(newest) // 8, j + SHARED_STRIDE - 1)
            while j < end and hashes[8 * j : 8 * j + 8] == newest[8 * j : 8 * j + 8]:
                j += 1
        return j


class PredictedLatencyParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    evictionPenalty: float = Field(
        1.0,
        ge=0,
        description="Share of an evicted token's recompute charged to the request that "
        "evicts it (0: ignore future misses; 1: every evicted token will be needed again).",
    )
    interferencePenalty: float = Field(
        1.0,
        ge=0,
        description="Share of this request's prefill charged when the endpoint is still "
        "prefilling another request (0: ignore the delay it adds to that request's first "
        "token; 1: charge it in full).",
    )
    duplicationPenalty: float = Field(
        1.0,
        ge=0,
        description="Share of the recompute charged for copying a prefix another endpoint "
        "holds into this one's free cache, scaled by how full the candidates' caches are "
        "(0: copies are free while the cache has room).",
    )
    decodeSecondsPerRequest: float = Field(
        0.0002, ge=0, description="Tie-break: added TTFT per running request."
    )
    costTolerance: float = Field(
        0.5,
        ge=0,
        description="Read an endpoint's learned prefill cost as the candidates' median one "
        "when its per-token cost is within this fraction of the median's (fit noise: on "
        "traces, identical engines' fits spread 30 % from their median); 0 keeps every "
        "endpoint's own fit.",
    )
    prefillChunkTokens: int = Field(
        2048,
        ge=1,
        description="The engines' prefill token budget per step (vLLM's "
        "max_num_batched_tokens): at most this much of a prefix another request is still "
        "computing is computed again by a request that hits it (burst accounting).",
    )
    attentionContextTokens: float = Field(
        30000.0,
        ge=0,
        description="The context length at which a prompt token's attention costs as much "
        "as the rest of its compute: params / (2 x layers x query heads x head dim), "
        "30.6k for Llama-3.1-8B, 54k for Llama-3.1-70B. A token after x tokens of context "
        "costs (1 + x / this) times a token at the start; 0: every token costs the same.",
    )
    workExternality: float = Field(
        1.0,
        ge=0,
        description="Share charged of the delay that prefill work spent beyond the "
        "cheapest candidate's adds to the requests arriving while the fleet's queue "
        "drains, and of the delay a prefill adds to the hits its engine's cache serves "
        "(0: each request minimises its own TTFT only).",
    )
    engineOrderWeight: float = Field(
        2.0,
        ge=0,
        description="Seconds of queue precedence a request gives up at the engine per "
        "second of its predicted prefill: the EPP sends x-infergate-order-delay = this x "
        "work, and an engine under --scheduling-policy priority orders its waiting queue "
        "by arrival + that delay, so short prefills overtake long ones (0: no header).",
    )
    secondsPerToken: float | None = Field(
        None, gt=0, description="Pin the prefill cost per uncached token instead of learning it."
    )
    baseSeconds: float | None = Field(
        None, ge=0, description="Pin the per-request prefill cost instead of learning it."
    )


class PredictedLatencyScorer(Scorer, PrefillEstimate, PreRequest, ResponseComplete):
    type_name = "predicted-latency-scorer"
    Params = PredictedLatencyParams

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.p: PredictedLatencyParams = params  # type: ignore[assignment]
        self.calibration = context.calibration
        self.clock = time.monotonic
        self._pinned: PrefillCost | None = None
        if self.p.secondsPerToken is not None or self.p.baseSeconds is not None:
            self._pinned = PrefillCost()
            if self.p.secondsPerToken is not None:
                self._pinned.per_token = self.p.secondsPerToken
            if self.p.baseSeconds is not None:
                self._pinned.base = self.p.baseSeconds
        #: Mean seconds from routing to completion, per endpoint key (``T(e)``).
        self._lifetime: dict[str, float] = {}
        #: Decayed cached and prompt tokens of completed responses (``reuse``).
        self._reuse_cached = 0.0
        self._reuse_prompt = 0.0
        #: Decayed uncached tokens, and uncached tokens x their mean context, of completed
        #: responses (the fits' mean context, :meth:`prefill_seconds`).
        self._mix_tokens = 0.0
        self._mix_context = 0.0
        #: Per endpoint key, the decayed uncached tokens and uncached tokens x their mean
        #: context of its completed responses (its fit's mix, :meth:`_cost`).
        self._endpoint_mix: dict[str, list[float]] = {}
        #: Prefixes of this EPP's requests in flight, per endpoint (the KV need, ``queue``).
        self.running = RunningPrefixes()
        #: When this EPP's recent picks were made, oldest first (``work externality``).
        self._pick_times: list[float] = []
        #: Per endpoint key, when this EPP's recent picks that hit its cache were made,
        #: oldest first (``block(e)``).
        self._hit_times: dict[str, collections.deque[float]] = {}
        context.extras.setdefault(LATENCY_MODEL, self)  # the bounded-load filter asks it

    @property
    def reuse(self) -> float:
        """The recent prefix-hit fraction of the fleet; 1 before any response reported."""
        if self._reuse_prompt <= 0:
            return 1.0
        return min(1.0, self._reuse_cached / self._reuse_prompt)

    @property
    def mean_context(self) -> float:
        """``m̄``: the mean context a prefilled token of the recent responses attended to,
        uncached-token weighted (``Σ u·(c + u/2) ÷ Σ u``); 0 before any response."""
        return self._mix_context / self._mix_tokens if self._mix_tokens > 0 else 0.0

    def prefill_work(self, cost: PrefillCost, uncached: float, cached: float) -> float:
        """Seconds of compute to prefill ``uncached`` tokens after ``cached`` ones.

        Attention makes a token after ``x`` tokens of context cost ``a·(1 + x/C)`` (``C``:
        ``attentionContextTokens``), so ``u`` new tokens after ``c`` cost ``a·u·(1 +
        (c + u/2)/C)``. The fitted ``per_token`` is a straight line through windows of
        the recent requests, so it is that cost averaged over their mix: ``per_token ≈
        a·(1 + m̄/C)`` with ``m̄`` :attr:`mean_context`. Hence ``a = per_token ÷ (1 +
        m̄/C)`` and::

            work(u, c) = per_token × u × (1 + (c + u/2)/C) ÷ (1 + m̄/C)

        A hit on ``c`` tokens then saves ``a·(c + c²/2C)``, what the engine really skips,
        and a prompt longer than the mix costs more than its share of the line: on an
        H100 with an 8B model a 190k-token prefill takes 23 s where the line through
        traced windows (fit 54 µs/token) said 10 s, and a 12k one 0.4 s where it said
        0.6. With ``C`` = 0 it is the straight line."""
        c_tokens = self.p.attentionContextTokens
        if c_tokens <= 0:
            return cost.per_token * uncached
        factor = (1.0 + (cached + uncached / 2.0) / c_tokens) / (1.0 + self.mean_context / c_tokens)
        return cost.per_token * uncached * factor

    def work_externality(
        self, waits: Sequence[float], works: Sequence[float], now: float
    ) -> list[float]:
        """Per candidate, the delay its choice adds to later requests (module docstring,
        "work externality"): ``workExternality × n × (work(e) − min work)``, with ``n``
        this EPP's picks over the last ``w̄`` seconds (``w̄`` the candidates' mean wait)
        divided by the number of candidates, and ``works`` priced at one common cost (the
        candidates' median fit): what differs between them is the prefix each holds. Priced
        at each one's own fit, the fits' noise (34-59 µs a token on identical engines) came
        out ``n`` times over: 2.0-2.5 s more work read as 7.6-9.8 s of delay to others,
        and two prompts of 79k and 73k tokens arriving together both went to the engine
        whose fit was cheapest, the second behind the first (11.4 s to its first token),
        while three engines sat idle (a slice of Mooncake's arxiv trace)."""
        backlog = sum(waits) / len(waits)
        if backlog <= 0.0:
            return [0.0] * len(works)
        times = self._pick_times
        behind = (len(times) - bisect.bisect_left(times, now - backlog)) / len(waits)
        least = min(works)
        return [self.p.workExternality * behind * (w - least) for w in works]

    def holder_blocking(
        self, endpoints: Sequence[EndpointState], works: Sequence[float], now: float
    ) -> list[float]:
        """Per candidate, the delay its prefill adds to the hits its engine's cache is
        about to serve (module docstring, ``block(e)``): ``workExternality × r(e) ×
        work(e)² ÷ 2``, ``r(e)`` this EPP's picks that hit ``e``'s cache per second over
        the last :data:`HIT_RATE_WINDOW_S`."""
        since = now - HIT_RATE_WINDOW_S
        out = []
        for e, work in zip(endpoints, works, strict=True):
            times = self._hit_times.get(e.key)
            if not times:
                out.append(0.0)
                continue
            while times and times[0] < since:
                times.popleft()
            rate = len(times) / HIT_RATE_WINDOW_S
            out.append(self.p.workExternality * rate * work * work / 2.0)
        return out

    def _note_hit(self, key: str, now: float) -> None:
        times = self._hit_times.get(key)
        if times is None:
            times = self._hit_times[key] = collections.deque(maxlen=HIT_HISTORY)
        times.append(now)

    def _note_pick(self, now: float) -> None:
        """Remember a pick's time (the last :data:`PICK_HISTORY`, for ``n``)."""
        times = self._pick_times
        times.append(now)
        if len(times) > 2 * PICK_HISTORY:
            del times[:PICK_HISTORY]

    def _prefix(self) -> Any:
        return self.context.extras.get("prefix_index")

    def _prompt_tokens(self, cycle: CycleState, request: InferenceRequest) -> float:
        exact = cycle.get("precise.tokens")
        if exact:
            return float(exact)
        tokens = cycle.get("prefix.tokens")
        if tokens is not None:
            return float(tokens)
        model = request.target_model or request.model
        return self.calibration.tokens(model, len(request.prompt_text))

    @staticmethod
    def _cached_tokens(cycle: CycleState) -> dict[str, float]:
        """Per endpoint, the tokens of the prompt it holds: the approximate index's
        estimate, or the precise one's where larger (module docstring, ``cached(e)``)."""
        cached: dict[str, float] = dict(cycle.get("prefix.cached_tokens") or {})
        for key, tokens in (cycle.get("precise.cached_tokens") or {}).items():
            cached[key] = max(cached.get(key, 0.0), float(tokens))
        return cached

    def prefill_seconds(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> float:
        """``min_e work(e)``: the prefill of what ``e`` does not hold (module docstring),
        at each endpoint's pooled cost; flow control orders held requests by it."""
        if not endpoints:
            return 0.0
        prompt = self._prompt_tokens(cycle, request)
        cached = self._cached_tokens(cycle)
        costs, _, _ = self._pool_costs(endpoints)
        works = []
        for e, cost in zip(endpoints, costs, strict=True):
            here = min(cached.get(e.key, 0.0), prompt)
            works.append(self.prefill_work(cost, max(1.0, prompt - here), here))
        return min(works)

    def predict(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> list[tuple[float, float]]:
        """Per endpoint: (predicted TTFT seconds, uncached tokens)."""
        if not endpoints:
            return []
        now = self.clock()
        prompt = self._prompt_tokens(cycle, request)
        cached = self._cached_tokens(cycle)
        prefix = self._prefix()
        model = request.target_model or request.model
        stale = self.context.saturation.is_stale
        out: list[tuple[float, float]] = []
        output = float(request.max_tokens or DEFAULT_OUTPUT_TOKENS)
        reuse = self.reuse
        room = prefix is not None and (self.p.evictionPenalty > 0 or self.p.duplicationPenalty > 0)
        # Free room per endpoint; reading it also refreshes the capacities occupancy() sums.
        frees = [prefix.free_tokens(e, model) if room else None for e in endpoints]
        copying = room and self.p.duplicationPenalty > 0 and bool(cached)
        fullness = prefix.occupancy(endpoints) if copying else 0.0
        # The two largest holders: what endpoint e would copy is the best one but itself.
        top = (
            [*heapq.nlargest(2, cached.items(), key=lambda kv: kv[1]), ("", 0.0)] if copying else []
        )
        costs, cycle["latency.clock_cost"], common = self._pool_costs(endpoints)
        hashes: bytes = cycle.get("prefix.hashes") or b""
        matches: dict[str, int] = cycle.get("prefix.matches") or {}
        needs: dict[str, float] = {}
        waits: list[float] = []
        works: list[float] = []
        for e, free, cost in zip(endpoints, frees, costs, strict=True):
            here = cached.get(e.key, 0.0)
            shared = self.running.shared_blocks(e.key, hashes) if prefix is not None else 0
            unshared = prompt - (prefix.tokens_for_blocks(model, shared) if shared else 0.0)
            needs[e.key] = max(1.0, prompt - here, unshared) + output
            ttft, uncached, wait = self._predict_one(
                e, cost, now, prompt, here, needs[e.key], output
            )
            waits.append(wait)
            works.append(self.prefill_work(common, uncached, prompt - uncached))
            if e.claimed_requests and matches.get(e.key):
                ttft += self._in_progress_seconds(
                    e, cost, now, hashes, matches[e.key], prefix, model
                )
            overflow = max(0.0, uncached - free) if free is not None else 0.0
            per_token = cost.per_token
            if self.p.evictionPenalty > 0:
                ttft += overflow * per_token * self.p.evictionPenalty * reuse
            if copying:
                elsewhere = top[0][1] if top[0][0] != e.key else top[1][1]
                copied = max(0.0, min(uncached, elsewhere - here) - overflow)
                ttft += copied * per_token * self.p.duplicationPenalty * reuse * fullness
            if stale(e, now):
                ttft += STALE_PENALTY_S
            out.append((ttft, uncached))
        if self.p.workExternality > 0 and len(out) > 1:
            extra = self.work_externality(waits, works, now)
            blocked = self.holder_blocking(endpoints, works, now)
            out = [(t + x + b, u) for (t, u), x, b in zip(out, extra, blocked, strict=True)]
        cycle["latency.predicted"] = {e.key: t for e, (t, _) in zip(endpoints, out, strict=True)}
        cycle["latency.uncached"] = {e.key: u for e, (_, u) in zip(endpoints, out, strict=True)}
        cycle["latency.kv_need"] = needs
        return out

    def _predict_one(
        self,
        e: EndpointState,
        cost: PrefillCost,
        now: float,
        prompt: float,
        cached: float,
        kv_need: float,
        output: float,
    ) -> tuple[float, float, float]:
        """(TTFT seconds without the eviction and staleness terms, uncached tokens, the
        wait before its prefill) of a ``prompt``-token request of which ``e`` holds
        ``cached``, at prefill ``cost``, taking ``kv_need`` tokens of ``e``'s KV cache
        (module docstring)."""
        uncached = max(1.0, prompt - cached)
        prefilling = max(
            e.prefill_busy_until - now, e.pending_prefill_seconds(cost.per_token, now), 0.0
        )
        wait = max(prefilling, e.metrics.waiting * cost.base)
        work = self.prefill_work(cost, uncached, prompt - uncached)
        lifetime = self._lifetime.get(e.key) or (
            cost.base + self.prefill_work(cost, prompt, 0.0) + output * PRIOR_DECODE_STEP_S
        )
        wait = max(wait, queue_seconds(e, kv_need, lifetime))
        ttft = wait + cost.base + work
        if prefilling > 0.0:
            # Shares the last step of the prefill in progress: delays that request's first
            # token by this one's tokens in that step, at most one step's budget.
            chunk = self.p.prefillChunkTokens * cost.per_token
            ttft += min(work, chunk) * self.p.interferencePenalty
        batch = max(e.in_flight_requests, e.metrics.running + e.picks_since_report)
        return ttft + batch * self.p.decodeSecondsPerRequest, uncached, wait

    def _in_progress_seconds(
        self,
        e: EndpointState,
        cost: PrefillCost,
        now: float,
        hashes: bytes,
        matched: int,
        prefix: Any,
        model: str,
    ) -> float:
        """What hitting a prefix that ``e`` is still computing costs (module docstring,
        "in-progress hits"): ``(1 + interferencePenalty) × per_token × min(pending,
        prefillChunkTokens)``, ``pending`` the tokens of the ``matched`` leading blocks that
        a pick of this same instant (the last ``SAME_STEP_S``) placed on ``e``.

        A claim placed them if its prompt has this prompt's last matched block at the same
        position (the hashes chain, so the whole matched prefix is then equal); of those,
        the blocks past what ``e`` held at that pick are not computed yet, and both
        requests will wait for the same step. A pick older than that has reached its
        engine, whose step computing it is under way: this request waits for it (the
        prefill clock) and hits what it computed. Only this instant's claims are read,
        newest first."""
        at = (matched - 1) * 8
        last = hashes[at : at + 8]
        pending = 0
        since = now - SAME_STEP_S
        for claim in reversed(e.claims):  # newest first: only this instant's picks count
            if claim.picked_at < since:
                break
            if claim.live and claim.hashes[at : at + 8] == last:
                pending = max(pending, matched - claim.cached_blocks)
        if pending <= 0 or prefix is None:
            return 0.0
        tokens = min(prefix.tokens_for_blocks(model, pending), float(self.p.prefillChunkTokens))
        return tokens * cost.per_token * (1.0 + self.p.interferencePenalty)

    def _cost(self, e: EndpointState) -> PrefillCost:
        """The endpoint's learned cost read at the fleet's mix, or the pinned one when the
        config pins it.

        A fit's ``per_token`` is ``a(e)·(1 + m(e)/C)``, with ``m(e)`` the mean context of
        the tokens *that endpoint* prefilled (:meth:`prefill_work`), and
        :meth:`prefill_work` divides by the fleet's ``1 + m̄/C``. So the fit is rescaled
        to the fleet's mix: ``per_token × (1 + m̄/C) ÷ (1 + m(e)/C)``. Why: on a trace
        whose prompts run from 1k to 190k tokens, the engine that served the long ones
        fitted 120 µs a token where its identical peers fitted 52 (Mooncake's shipped
        trace), and was read as a slower engine."""
        if self._pinned is not None:
            return self._pinned
        cost, c_tokens = e.cost, self.p.attentionContextTokens
        mix = self._endpoint_mix.get(e.key)
        if c_tokens <= 0 or mix is None or mix[0] <= 0 or not cost.observations:
            return cost
        rescale = (1.0 + self.mean_context / c_tokens) / (1.0 + mix[1] / mix[0] / c_tokens)
        return PrefillCost(cost.base, cost.per_token * rescale, observations=cost.observations)

    def _pool_costs(
        self, endpoints: Sequence[EndpointState]
    ) -> tuple[list[PrefillCost], dict[str, PrefillCost], PrefillCost]:
        """Each candidate's cost for this prediction (``endpoints`` is not empty: both
        callers return before): its own fit, or the candidates' median fit where its
        ``per_token`` is within ``costTolerance`` of the median's, is under
        :data:`CHEAP_FIT_SHARE` of it, or has no window yet (module docstring). The
        median is the fitted candidates' lower median by ``per_token`` (one of the fits,
        never an average), each fit read at the fleet's mix (:meth:`_cost`). Also, by
        endpoint key, the median for each fitted endpoint replaced as too cheap (its clock
        advances by it), and the median itself (the work externality's common price).

        Why ``per_token`` and not the seconds for this prompt: the fit's two parameters
        trade against each other, so a fit whose base took the time (0.13 s and 12 µs a
        token, against peers' 0.01 s and 44 µs) priced a short prompt about right and was
        kept, and then priced the queue of other prompts' tokens, and every long prompt,
        at a quarter of their cost. The base of a fit on identical engines is the wait of
        a short prompt behind a long one's steps, which the wait terms count already."""
        costs = [self._cost(e) for e in endpoints]
        if self._pinned is not None or len(costs) < 2:
            return costs, {}, costs[0]
        fitted = sorted((c.per_token, i) for i, c in enumerate(costs) if c.observations > 0)
        if not fitted:
            return costs, {}, costs[0]
        reference, at = fitted[(len(fitted) - 1) // 2]
        median, band = costs[at], self.p.costTolerance * reference
        floor = CHEAP_FIT_SHARE * reference
        pooled = [
            median
            if not c.observations or c.per_token < floor or abs(c.per_token - reference) <= band
            else c
            for c in costs
        ]
        too_cheap = {
            e.key: median
            for e, c in zip(endpoints, costs, strict=True)
            if c.observations and c.per_token < floor
        }
        return pooled, too_cheap, median

    def score(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> list[float]:
        predicted = self.predict(cycle, request, endpoints)
        if not predicted:
            return []
        best = min(t for t, _ in predicted)
        return [best / t if t > 0 else 1.0 for t, _ in predicted]

    def pre_request(
        self, cycle: CycleState, request: InferenceRequest, result: SchedulingResult
    ) -> None:
        """Add the request's prefill work to the chosen endpoint's virtual clock, and its
        claim (KV tokens, slot, prefill, prompt blocks) to the endpoint's state, so the
        next request of the same burst sees it (module docstring, "burst accounting")."""
        primary = result.primary
        if primary is None:
            return
        uncached = (cycle.get("latency.uncached") or {}).get(primary.key)
        if uncached is None:
            return
        now = self.clock()
        self._note_pick(now)
        output = float(request.max_tokens or DEFAULT_OUTPUT_TOKENS)
        kv_need = (cycle.get("latency.kv_need") or {}).get(primary.key, uncached + output)
        hashes: bytes = cycle.get("prefix.hashes") or b""
        matches: dict[str, int] = cycle.get("prefix.matches") or {}
        if hashes:
            sampled = RunningPrefixes.sample(hashes)
            self.running.add(primary.key, hashes, sampled)
            request.notes[RUNNING_NOTE] = (primary.key, hashes, sampled)
        if result.remote_prefill:  # another endpoint prefills (P/D): only the KV lands here
            claim = Claim(now, kv_need, 0.0)
        else:
            prompt = self._prompt_tokens(cycle, request)
            if prompt > 0 and prompt - uncached >= HIT_SHARE * prompt:
                self._note_hit(primary.key, now)
            clock_cost = (cycle.get("latency.clock_cost") or {}).get(primary.key)
            work = self.prefill_work(
                clock_cost or self._cost(primary), uncached, max(0.0, prompt - uncached)
            )
            primary.prefill_busy_until = max(primary.prefill_busy_until, now) + work
            if self.p.engineOrderWeight > 0:
                delay = min(self.p.engineOrderWeight * work, MAX_ORDER_DELAY_S)
                result.request_headers[ORDER_DELAY_HEADER] = f"{delay:.6f}"
            claim = Claim(now, kv_need, uncached, hashes, matches.get(primary.key, 0))
        primary.claim(claim)
        request.notes[CLAIM_NOTE] = (primary, claim)
        request.notes["latency.predicted_ttft"] = (cycle.get("latency.predicted") or {}).get(
            primary.key
        )
        request.notes["latency.routed_at"] = now

    def response_complete(
        self, request: InferenceRequest, result: SchedulingResult, response: ResponseInfo
    ) -> None:
        """Release the request's claim; learn ``T(e)`` (routing to completion of a successful
        request) and ``reuse``."""
        placed: tuple[EndpointState, Claim] | None = request.notes.pop(CLAIM_NOTE, None)
        if placed is not None:
            placed[0].release(placed[1])
        running: tuple[str, bytes, list[bytes]] | None = request.notes.pop(RUNNING_NOTE, None)
        if running is not None:
            self.running.remove(*running)
        routed_at = request.notes.get("latency.routed_at")
        primary = result.primary
        if routed_at is None or primary is None or not 200 <= response.status < 300:
            return
        key = response.served_endpoint or primary.key  # Envoy may have used a fallback
        if response.prompt_tokens:
            keep = 1.0 - REUSE_DECAY
            if self._reuse_prompt <= 0:  # the prior, in this fleet's prompt sizes
                prior = REUSE_PRIOR_RESPONSES * response.prompt_tokens
                self._reuse_prompt = self._reuse_cached = prior
            self._reuse_prompt = self._reuse_prompt * keep + response.prompt_tokens
            self._reuse_cached = self._reuse_cached * keep + (response.cached_tokens or 0)
            hit = min(response.cached_tokens or 0, response.prompt_tokens)
            new = response.prompt_tokens - hit
            context = new * (hit + new / 2.0)  # Σ over the new tokens of the context each reads
            self._mix_tokens = self._mix_tokens * keep + new
            self._mix_context = self._mix_context * keep + context
            mix = self._endpoint_mix.setdefault(key, [0.0, 0.0])
            mix[0] = mix[0] * (1.0 - ENDPOINT_MIX_DECAY) + new
            mix[1] = mix[1] * (1.0 - ENDPOINT_MIX_DECAY) + context
        seconds = self.clock() - routed_at
        old = self._lifetime.get(key)
        self._lifetime[key] = seconds if old is None else old + LIFETIME_EWMA * (seconds - old)
        if len(self._lifetime) > 4 * max(1, len(self.context.datastore)):
            live = {s.key for s in self.context.datastore.all()}
            self._lifetime = {k: v for k, v in self._lifetime.items() if k in live}
            self._endpoint_mix = {k: v for k, v in self._endpoint_mix.items() if k in live}
            self._hit_times = {k: v for k, v in self._hit_times.items() if k in live}


def queue_seconds(e: EndpointState, need_tokens: float, lifetime: float) -> float:
    """How long a request needing ``need_tokens`` of KV cache waits for room on ``e``.

    ``(waiting + k) × T ÷ n`` (module docstring): ``n`` requests on ``e`` complete at
    ``n ÷ T`` per second; the request waits for the ``waiting`` ahead of it, then for the
    ``k`` completions that free the cache it needs (``k`` is 0 when the engine reports no
    cache size or runs nothing). Zero when nothing is queued and the cache has room.

    The report's cache and batch are taken with this EPP's unreported picks on top
    (burst accounting): ``used = capacity × kv_usage + Σ claim.kv_tokens``, ``running =
    running + claims``, ``free = capacity − used``, ``held = used ÷ running``."""
    m = e.metrics
    n = endpoint_load(e)
    if n == 0:
        return 0.0
    k = 0.0
    capacity = m.capacity_tokens
    running = m.running + e.claimed_requests  # this EPP's picks the report does not show
    if capacity > 0 and running > 0:
        used = capacity * m.kv_usage + e.claimed_kv_tokens
        free = capacity - used
        if need_tokens > free:
            held = used / running
            k = math.ceil((need_tokens - free) / max(held, 1.0))
    if m.waiting == 0 and k == 0:
        return 0.0
    return (m.waiting + min(k, n)) * lifetime / n


register(PredictedLatencyScorer)
