"""Plain data the EPP passes between its parts: endpoints, metric snapshots, requests."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from infergate.epp.prefill_cost import PrefillCost


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One engine server the pool can route to (a pod IP × a target port)."""

    address: str
    port: int
    labels: tuple[tuple[str, str], ...] = ()
    #: ``ip:port`` — how Envoy names a host in its pick header and EDS (computed once).
    key: str = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        host = (
            f"[{self.address}]"
            if ":" in self.address and not self.address.startswith("[")
            else self.address
        )
        object.__setattr__(self, "key", f"{host}:{self.port}")

    def label(self, name: str, default: str | None = None) -> str | None:
        for key, value in self.labels:
            if key == name:
                return value
        return default


@dataclass(slots=True)
class Metrics:
    """The latest scrape of one endpoint's ``/metrics``; ``updated_at`` 0 means never."""

    waiting: int = 0
    running: int = 0
    #: Whether the scrape had both the running and waiting gauges (else they read 0).
    counts_reported: bool = False
    kv_usage: float = 0.0
    active_models: frozenset[str] = frozenset()
    waiting_models: frozenset[str] = frozenset()
    max_active_models: int = 0
    block_size: int = 0
    num_gpu_blocks: int = 0
    #: Cumulative engine counters (for rates between scrapes): prefill time of finished
    #: requests (sum, count), their prompt tokens (sum), and prompt tokens looked up in /
    #: hit in the prefix cache.
    prefill_seconds_sum: float = 0.0
    prefill_count: float = 0.0
    prompt_tokens_total: float = 0.0
    prefix_hits_total: float = 0.0
    prefix_queries_total: float = 0.0
    #: Prompt tokens of the engine's running requests not computed yet, whoever routed
    #: them (load reports only; 0 from a scrape): prefill another replica started.
    prefill_pending_tokens: float = 0.0
    #: Waiting requests' prompt tokens not in the engine's prefix cache at their arrival
    #: (load reports only): the prefill queued behind the running requests'.
    prefill_waiting_tokens: float = 0.0
    updated_at: float = 0.0
    #: Set when the snapshot is a pushed load report (:mod:`infergate.wire.load`): the
    #: engine's sampling tick and heartbeat, and how long the report took to arrive.
    #: 0 for a scrape.
    tick: float = 0.0
    heartbeat: float = 0.0
    lag: float = 0.0

    @property
    def pushed(self) -> bool:
        return self.heartbeat > 0.0

    def freshness(self, now: float) -> float:
        """How old the engine state behind this snapshot may be, in seconds.

        A scrape is as old as the scrape. A pushed report is replaced as soon as the
        engine's state changes (within its tick plus the delivery lag), so while its
        heartbeats keep arriving (the last report is younger than 1.5 heartbeats) the
        state can miss at most the last tick's changes; after that, its plain age.
        """
        age = self.age(now)
        if self.heartbeat > 0.0 and age <= 1.5 * self.heartbeat:
            return min(age, self.tick + self.lag)
        return age

    @property
    def capacity_tokens(self) -> int:
        """Tokens the engine's KV cache holds (0: unknown)."""
        return self.block_size * self.num_gpu_blocks

    def age(self, now: float | None = None) -> float:
        if self.updated_at == 0.0:
            return float("inf")
        return (time.monotonic() if now is None else now) - self.updated_at


#: How long a routed request may take to reach its engine (through the gateway), seconds.
#: A report the engine sampled later than this after a pick shows that pick (its queue, its
#: KV blocks, its prefill), so the pick's claim is settled by it; an earlier report does not.
REACH_S = 0.02
#: Claims kept per endpoint at most (an engine that never reports settles none of them).
MAX_CLAIMS = 1024


@dataclass(slots=True)
class Claim:
    """What one of this EPP's picks is predicted to take on its endpoint, counted from the
    moment of the pick until the engine's own report shows it (burst accounting).

    Requests of a burst arrive in the same instant and are placed one after another; the
    engine's counts (running, waiting, KV usage, pending prefill) show a request only once
    it has reached the engine and the engine has reported since. Until then the claim
    stands for it: ``kv_tokens`` of KV cache (its uncached prompt plus its output budget),
    one batch slot, ``prefill_tokens`` of prefill work, and the prompt's block ``hashes``
    of which ``cached_blocks`` were already held there (the rest is to be computed).
    Settled by :meth:`EndpointState.settle_claims`
    (a report sampled at least :data:`REACH_S` after the pick) or released when the
    request ends, whichever comes first."""

    picked_at: float
    kv_tokens: float
    prefill_tokens: float
    hashes: bytes = b""
    cached_blocks: int = 0
    live: bool = True


@dataclass(slots=True)
class EndpointState:
    """An endpoint with its live metrics and EPP-side accounting."""

    endpoint: Endpoint
    metrics: Metrics = field(default_factory=Metrics)
    in_flight_requests: int = 0
    in_flight_tokens: int = 0
    #: Per-endpoint prefill cost learned from the engine's counters.
    cost: PrefillCost = field(default_factory=PrefillCost)
    #: Predicted-latency bookkeeping: when the prefill work routed here so far is
    #: predicted to be done (``time.monotonic()`` clock; see scheduling/plugins/latency.py).
    prefill_busy_until: float = 0.0
    #: Prompt and cached tokens of the responses from this endpoint that completed (from
    #: their usage): the hit fraction of exactly the requests the engine's completion-time
    #: histograms describe.
    completed_prompt_tokens: int = 0
    completed_cached_tokens: int = 0
    #: This EPP's picks of the endpoint, and its requests there that finished, since the
    #: engine's latest load report (``metrics.updated_at`` as of ``_report_seen``).
    picks_since_report: int = 0
    done_since_report: int = 0
    #: This EPP's picks here that no report has shown yet (:class:`Claim`, oldest first),
    #: and the sums of the live ones: KV tokens, prefill tokens, requests.
    claims: deque[Claim] = field(default_factory=deque)
    claimed_kv_tokens: float = 0.0
    claimed_prefill_tokens: float = 0.0
    claimed_requests: int = 0
    _report_seen: float = 0.0

    @property
    def key(self) -> str:
        return self.endpoint.key

    def _sync_report(self) -> None:
        if self.metrics.updated_at != self._report_seen:
            self._report_seen = self.metrics.updated_at
            self.picks_since_report = 0
            self.done_since_report = 0
            self.settle_claims(self.metrics.updated_at - self.metrics.lag - REACH_S)

    def claim(self, claim: Claim) -> None:
        """Count a pick's predicted KV tokens, prefill and slot here until a report shows
        it or it ends (:class:`Claim`)."""
        self._sync_report()
        self.claims.append(claim)
        self.claimed_kv_tokens += claim.kv_tokens
        self.claimed_prefill_tokens += claim.prefill_tokens
        self.claimed_requests += 1
        while len(self.claims) > MAX_CLAIMS:
            self.release(self.claims.popleft())

    def release(self, claim: Claim) -> None:
        """The claim's request ended (or a report showed it): stop counting it."""
        if not claim.live:
            return
        claim.live = False
        self.claimed_kv_tokens = max(0.0, self.claimed_kv_tokens - claim.kv_tokens)
        self.claimed_prefill_tokens = max(0.0, self.claimed_prefill_tokens - claim.prefill_tokens)
        self.claimed_requests = max(0, self.claimed_requests - 1)
        claims = self.claims
        while claims and not claims[0].live:
            claims.popleft()

    def settle_claims(self, sampled_before: float) -> None:
        """Release the claims of picks made at or before ``sampled_before`` (monotonic
        clock): the engine had them when it sampled the report now in :attr:`metrics`, so
        the report's counts include them. Claims are kept in pick order, so this pops from
        the left only: O(claims settled)."""
        claims = self.claims
        while claims and claims[0].picked_at <= sampled_before:
            self.release(claims[0])  # the oldest is live: release pops every dead one

    def note_pick(self) -> None:
        """This EPP sent a request here (counted in :attr:`in_flight_requests` too)."""
        self._sync_report()
        self.in_flight_requests += 1
        self.picks_since_report += 1

    def note_done(self) -> None:
        """A request this EPP sent here finished."""
        self._sync_report()
        self.in_flight_requests = max(0, self.in_flight_requests - 1)
        self.done_since_report += 1

    def pending_prefill_seconds(self, per_token: float, now: float) -> float:
        """Prefill work ahead of a new request here, whoever routed it, in seconds:
        ``max(0, pending × per_token − age) + sent × per_token``, with ``pending`` the
        engine's running prompt tokens not yet computed at its last load report and its
        waiting requests' tokens that were not cached when they arrived (the engine
        prefills both before a request that comes now; without the waiting ones, an
        engine whose full KV cache held 3-9 requests and 70k-280k tokens of prefill in
        its waiting queue looked 1-2 s from free and took the next long prompts, served
        10-27 s later: a slice of Mooncake's arxiv trace), ``age``
        the report's age (the engine has worked that long since), and ``sent`` the uncached
        tokens of this EPP's picks here that the report does not show yet (its live
        :class:`Claim` s; not drained: the next report, within a tick of the change they
        make, replaces them). 0 for an endpoint that does not push (a scrape does not carry
        it)."""
        self._sync_report()
        m = self.metrics
        if not m.pushed:
            return 0.0
        age = max(0.0, now - m.updated_at)
        queued = m.prefill_pending_tokens + m.prefill_waiting_tokens
        reported = max(0.0, queued * per_token - age)
        return reported + self.claimed_prefill_tokens * per_token

    def load(self) -> int:
        """Requests on the endpoint, whoever sent them.

        The engine's report (running + waiting) counts every router's requests, EPP
        replicas included, as of the report; this EPP's own picks and finishes since then
        correct it. Never less than this EPP's own in-flight count (an engine that
        reports no counts, or a report that has not yet seen a burst of picks). With one
        replica and a fresh report the two agree."""
        self._sync_report()
        m = self.metrics
        if m.updated_at == 0.0:
            return self.in_flight_requests
        reported = m.running + m.waiting + self.picks_since_report - self.done_since_report
        return max(self.in_flight_requests, reported)


#: The APIs whose bodies the EPP parses (``InferenceRequest.api``). For the Responses and
#: Anthropic Messages APIs the parser renders the conversation into ``prompt_text`` (one
#: line per item, roles included) and the prefix index hashes that text; chat bodies are
#: hashed as their ``messages`` JSON.
CHAT_API = "chat"
COMPLETIONS_API = "completions"
RESPONSES_API = "responses"
ANTHROPIC_MESSAGES_API = "anthropic-messages"
#: APIs whose ``prompt_text`` is the rendered conversation the prefix index hashes.
RENDERED_APIS = frozenset({RESPONSES_API, ANTHROPIC_MESSAGES_API})


@dataclass(slots=True)
class InferenceRequest:
    """What scheduling plugins see of one request (parsed once, at end of body)."""

    request_id: str
    headers: dict[str, str]
    body: dict[str, Any] | None = None
    model: str = ""
    target_model: str = ""
    prompt_text: str = ""
    cache_salt: str = ""
    stream: bool = False
    max_tokens: int | None = None
    objective: str = ""
    priority: int = 0
    prompt_tokens_estimate: int = 0
    #: Which API the body was parsed as (``CHAT_API``, ``RESPONSES_API``…); "" before
    #: parsing or for requests without a body.
    api: str = ""
    #: A Responses request's ``previous_response_id`` ("" when it names none): the turn
    #: continues a conversation an engine holds (its KV blocks and its response store).
    previous_response_id: str = ""
    #: Per-request notes plugins keep from scheduling to the response (e.g. the prefix
    #: index's prediction, checked against the response's ``cached_tokens``).
    notes: dict[str, Any] = field(default_factory=dict)


class CycleState(dict[str, Any]):
    """Per-request scratch space shared by plugins within one scheduling cycle."""
