"""Predicted-latency scoring: send each request where its first token comes soonest.

For every candidate endpoint ``e`` the scorer predicts this request's time to first
token there (all times in seconds)::

    ttft(e) = wait(e) + base(e) + per_token(e) × uncached(e) + evict(e) + busy(e)

* ``uncached(e) = prompt_tokens − cached(e)``: ``prompt_tokens`` is the prompt's length
  in characters over the learned characters-per-token; ``cached(e)`` is what the prefix
  index (``prefix-cache-scorer``, calibrated by the engines) predicts ``e`` holds. When
  ``precise-prefix-cache-scorer`` runs too (engines publishing KV events), its exact
  token count and the larger of the two cached estimates are used: events are the truth
  once they arrive, the approximate index covers the window before they do.
* ``base(e)``, ``per_token(e)``: the endpoint's own prefill cost, fitted online from its
  ``vllm:request_prefill_time_seconds`` and prompt/hit token counters
  (:mod:`infergate.epp.prefill_cost`) — a slow engine learns a large
  ``per_token``.
* ``wait(e)``: prefill work already queued there. The EPP keeps a virtual clock per
  endpoint: routing a request adds ``per_token × uncached`` seconds of work, and the work
  drains at one second per second (an engine works through its prefills at its own pace),
  so ``wait = max(0, busy_until − now)``. The engine's reported waiting queue sets a floor
  (``waiting × base``) for work that did not come through this EPP.
* ``evict(e)``: what loading this prompt will cost *later*. If the uncached tokens do
  not fit in the part of ``e``'s KV cache the index believes free, the overflow evicts
  other prefixes that will have to be recomputed: ``overflow_tokens × per_token ×
  evictionPenalty``. This keeps prefix groups from being scattered over every cache (which
  is what makes a tight-capacity fleet thrash) while still letting a group move when its
  holder's queue costs more than recomputing it elsewhere.
* ``busy(e) = running(e) × decodeSecondsPerRequest``: a small tie-break for decode load.
* An endpoint whose metrics are stale (DESIGN.md: stale means saturated; a dead engine
  stops answering its scrapes) gets ``STALE_PENALTY_S`` added, so it is chosen only when
  every candidate is stale.

The score is ``min_e ttft(e) / ttft(e)``, in (0, 1]: the fastest endpoint scores 1.

Why this does not starve a hot group: every request routed to the holder adds its own
uncached work to the holder's clock, so once the holder's queue is longer than the
recompute a second endpoint would need, the second endpoint *is* the predicted-faster
choice and the group spreads; the eviction term makes that second endpoint the one with
the most room. References read: NVIDIA Dynamo's KV router (overlap blocks against decode
load) and GIE's latency-predictor proposal; the model here is a deliberately simple
linear one whose parameters are learned per endpoint.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from infergate.epp.framework.requestcontrol import PreRequest
from infergate.epp.prefill_cost import PrefillCost
from infergate.epp.scheduling.plugins.base import PluginContext, SchedulingResult, Scorer, register
from infergate.epp.types import CycleState, EndpointState, InferenceRequest
from pydantic import BaseModel, ConfigDict, Field

#: Added to the prediction of an endpoint with stale metrics (seconds).
STALE_PENALTY_S = 60.0


class PredictedLatencyParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    evictionPenalty: float = Field(
        1.0,
        ge=0,
        description="Share of an evicted token's recompute charged to the request that "
        "evicts it (0: ignore future misses; 1: every evicted token will be needed again).",
    )
    decodeSecondsPerRequest: float = Field(
        0.0002, ge=0, description="Tie-break: added TTFT per running request."
    )
    secondsPerToken: float | None = Field(
        None, gt=0, description="Pin the prefill cost per uncached token instead of learning it."
    )
    baseSeconds: float | None = Field(
        None, ge=0, description="Pin the per-request prefill cost instead of learning it."
    )


class PredictedLatencyScorer(Scorer, PreRequest):
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

    def predict(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> list[tuple[float, float]]:
        """Per endpoint: (predicted TTFT seconds, uncached tokens)."""
        now = self.clock()
        prompt = self._prompt_tokens(cycle, request)
        cached: dict[str, float] = dict(cycle.get("prefix.cached_tokens") or {})
        for key, tokens in (cycle.get("precise.cached_tokens") or {}).items():
            cached[key] = max(cached.get(key, 0.0), float(tokens))
        prefix = self._prefix()
        model = request.target_model or request.model
        stale = self.context.saturation.is_stale
        out: list[tuple[float, float]] = []
        for e in endpoints:
            cost = self._cost(e)
            uncached = max(1.0, prompt - cached.get(e.key, 0.0))
            wait = max(e.prefill_busy_until - now, e.metrics.waiting * cost.base, 0.0)
            ttft = wait + cost.seconds(uncached)
            if prefix is not None and self.p.evictionPenalty > 0:
                free = prefix.free_tokens(e, model)
                if free is not None and uncached > free:
                    ttft += (uncached - free) * cost.per_token * self.p.evictionPenalty
            ttft += max(e.in_flight_requests, e.metrics.running) * self.p.decodeSecondsPerRequest
            if stale(e, now):
                ttft += STALE_PENALTY_S
            out.append((ttft, uncached))
        cycle["latency.predicted"] = {e.key: t for e, (t, _) in zip(endpoints, out, strict=True)}
        cycle["latency.uncached"] = {e.key: u for e, (_, u) in zip(endpoints, out, strict=True)}
        return out

    def _cost(self, e: EndpointState) -> PrefillCost:
        """The endpoint's learned cost, or the pinned one when the config pins it."""
        if self._pinned is None:
            return e.cost
        return self._pinned

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
        """Add the request's prefill work to the chosen endpoint's virtual clock."""
        primary = result.primary
        if primary is None or result.remote_prefill:
            return  # another endpoint prefills (P/D): no prefill work lands here
        uncached = (cycle.get("latency.uncached") or {}).get(primary.key)
        if uncached is None:
            return
        now = self.clock()
        work = self._cost(primary).per_token * uncached
        primary.prefill_busy_until = max(primary.prefill_busy_until, now) + work
        request.notes["latency.predicted_ttft"] = (cycle.get("latency.predicted") or {}).get(
            primary.key
        )


register(PredictedLatencyScorer)
