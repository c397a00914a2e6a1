"""Candidate sampling: score a bounded set of endpoints however large the pool.

Every filter and scorer after this one costs a few microseconds per candidate, so a
decision over a 1,000-endpoint pool costs milliseconds, and most of that work scores
endpoints that cannot win: they hold nothing of the request's prompt and are as loaded
as any other. ``candidate-sampling-filter`` keeps, on a pool larger than
``sampleThreshold``:

* every endpoint the prefix index believes holds a prefix of this request
  (``prefix.cached_tokens``, and ``precise.cached_tokens`` when KV events run): a cache
  hit is the one thing a random endpoint cannot offer;
* every endpoint that has the request's model running or waiting as an adapter (from a
  map rebuilt at most once per ``adapterRefreshSeconds``, so the pass over the fleet is
  not on the request path);
* ``sampleSize`` other endpoints drawn uniformly at random.

The random part is the "power of d choices" (Mitzenmacher, 2001): a request placed on the
least loaded of ``d`` random endpoints keeps the busiest endpoint's load within
``ln ln N ÷ ln d`` of the mean, against ``ln N ÷ ln ln N`` for one random choice, and
gains little past a few choices; with ``d = 32`` the sample holds, with probability
``1 − (1 − q)^32``, one of the ``q`` fraction of least loaded endpoints (``q = 10 %``:
96.6 %). The fair share ``bounded-load-filter`` computes over the sample is an unbiased
estimate of the pool's. Below the threshold nothing is dropped, so small pools route
exactly as without the filter.

Cost: ``O(holders + sampleSize)`` per request (``random.sample`` draws indices, and the
holders come from dictionaries the prefix scorers filled in their prepare step), instead
of ``O(N)`` for every later plugin.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

from infergate.epp.scheduling.plugins.base import Filter, PluginContext, register
from infergate.epp.types import CycleState, EndpointState, InferenceRequest
from pydantic import BaseModel, ConfigDict, Field


class CandidateSamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sampleThreshold: int = Field(
        64, ge=1, description="Pools with at most this many candidates are kept whole."
    )
    sampleSize: int = Field(
        32, ge=1, description="Random endpoints kept besides the cache and adapter holders."
    )
    adapterRefreshSeconds: float = Field(
        1.0, gt=0, description="How often the adapter → endpoints map is rebuilt."
    )


@register
class CandidateSamplingFilter(Filter):
    """Keep the request's cache and adapter holders plus a uniform random sample."""

    type_name = "candidate-sampling-filter"
    Params = CandidateSamplingParams

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.p: CandidateSamplingParams = params  # type: ignore[assignment]
        self.rng = random.Random()
        self.clock = time.monotonic
        self._adapters: dict[str, set[str]] = {}
        self._adapters_at = float("-inf")

    def filter(
        self, cycle: CycleState, request: InferenceRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        if len(endpoints) <= self.p.sampleThreshold:
            return endpoints
        wanted = self._holders(cycle, request, endpoints)
        kept = self._present(wanted, endpoints) if wanted else []
        keys = {e.key for e in kept}
        for i in self.rng.sample(range(len(endpoints)), min(len(endpoints), self.p.sampleSize)):
            e = endpoints[i]
            if e.key not in keys:
                keys.add(e.key)
                kept.append(e)
        return kept

    def _present(self, keys: set[str], endpoints: list[EndpointState]) -> list[EndpointState]:
        """The candidates among ``keys``. When the candidates are the whole pool (the same
        count as the datastore, of which they are a subset) each key is looked up there,
        ``O(len(keys))``; otherwise one pass over the candidates."""
        store = self.context.datastore
        if len(endpoints) == len(store):
            found = (store.get(k) for k in keys)
            return [e for e in found if e is not None]
        return [e for e in endpoints if e.key in keys]

    def _holders(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> set[str]:
        wanted: set[str] = set(cycle.get("prefix.cached_tokens") or ())
        wanted.update(cycle.get("precise.cached_tokens") or ())
        model = request.target_model or request.model
        if model:
            wanted.update(self._adapter_holders(model, endpoints))
        return wanted

    def _adapter_holders(self, model: str, endpoints: Sequence[EndpointState]) -> set[str]:
        """Endpoints with ``model`` running or waiting as an adapter, from a map rebuilt at
        most every ``adapterRefreshSeconds`` (one pass over the pool per refresh)."""
        now = self.clock()
        if now - self._adapters_at >= self.p.adapterRefreshSeconds:
            self._adapters_at = now
            adapters: dict[str, set[str]] = {}
            for e in endpoints:
                m = e.metrics
                for name in m.active_models | m.waiting_models:
                    adapters.setdefault(name, set()).add(e.key)
            self._adapters = adapters
        return self._adapters.get(model, set())
