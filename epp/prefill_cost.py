"""What a prefill costs on one endpoint, learned online from the engine's own counters.

Model (a straight line per endpoint, fitted by ridge-regularised least squares)::

    prefill_seconds(request) = base + per_token × uncached_prompt_tokens

``base`` is the step the request waits for its first token even when every prompt token
is cached; ``per_token`` is the marginal compute of one uncached prompt token, averaged
over the recent requests. A token's real cost grows with the context it attends to, so
the predicted-latency scorer reads ``per_token`` as that cost at the mix's mean context
and scales it per request (``PredictedLatencyScorer.prefill_work``); the fit stays a
line because the counters give only sums over a window.

The observations are differences of vLLM's counters over a window of scrapes (at least
``window_s`` seconds and ``window_requests`` finished requests): ``Δt`` = Δ
``vllm:request_prefill_time_seconds_sum``, ``Δn`` = Δ its ``_count``, and ``Δu`` = Δ
``vllm:request_prompt_tokens_sum`` × (1 − h), where ``h`` is the window's prefix-hit
fraction: best, cached ÷ prompt tokens summed over the responses this EPP saw complete
on that endpoint in the window (their ``usage``), which are the very requests the
completion-time histograms describe; the window's other prompt tokens (other EPP
replicas' requests) at the engine's Δ ``vllm:prefix_cache_hits_total`` ÷ Δ
``vllm:prefix_cache_queries_total`` less what this EPP saw (:func:`window_hit_fraction`).
Each window contributes one equation ``Δt ≈ base·Δn + per_token·Δu``; the fit
minimises ``Σ w_i (Δt_i − base·Δn_i − per_token·Δu_i)² + ρ_b (base − b₀)² +
ρ_c (per_token − c₀)²``, where the weights decay by ``forget`` per finished request (the
recent ~``1/(1−forget)`` requests dominate, so a slower or busier engine is noticed) and
the ridge terms pull an endpoint with little traffic toward the prior.

The prefill-time and prompt-length histograms are both observed when a request finishes,
so ``Δt``, ``Δn`` and the prompt tokens describe the same requests. Prefix hits and
lookups are counted at admission, a request's lifetime earlier, so only their *ratio*
is used, over windows of seconds (a first version regressed on single 50 ms scrapes of
admission-time token counters and learned a per-token cost of ~0; the admission-time
hit ratio was unbiased but noisy enough to mislead routing on a tight-cache fleet).
Because each engine has its own fit, a fleet where one engine is twice as slow learns
that, and the predicted-latency scorer routes accordingly.

Every ``EndpointState`` carries one (``state.cost``), so this module sits at the bottom of
the EPP beside :mod:`infergate.epp.types` and imports nothing of the EPP: the data layer's
collector feeds it, the predicted-latency scorer reads it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

#: Priors: 10 ms per prefill step and 50 µs per uncached prompt token (an 8B model on one
#: modern GPU is 20-60 µs); ``PRIOR_REQUESTS`` requests' worth of confidence.
PRIOR_BASE_S = 0.010
PRIOR_PER_TOKEN_S = 50e-6
PRIOR_REQUESTS = 4.0
PRIOR_TOKENS = 1000.0


def window_hit_fraction(
    prompt: float, seen_prompt: float, seen_cached: float, hits: float, queries: float
) -> float:
    """The prefix-hit fraction of a window's ``prompt`` tokens (the requests that finished
    in it): the responses this EPP saw there count exactly (``seen_cached ÷
    seen_prompt``), the rest at the engine's own ratio for the requests this EPP did not
    see (``(hits − seen_cached) ÷ (queries − seen_prompt)``; the engine counts at
    admission, so where that is not positive, ``hits ÷ queries``).

    One EPP sees every response, so the rest is nothing (or a request on the window's
    edge). With N replicas each sees about 1/N of them: taken alone, one or two
    responses stood for the window (a cold one in a window of hits, or the reverse), so
    identical engines' ``per_token`` fits spread from 11 to 55 µs across replicas (one
    replica: 31-40), beyond ``costTolerance``, and a cold group was placed by that noise
    on an engine whose cache was already full (docs/benchmarks/scale.md, "Replicas")."""
    rest = max(0.0, prompt - seen_prompt)
    if queries <= 0.0 or rest <= 0.0:
        fraction = seen_cached / seen_prompt if seen_prompt > 0 else 0.0
    else:
        others = queries - seen_prompt
        ratio = (hits - seen_cached) / others if others > 0 else hits / queries
        fraction = (seen_cached + rest * min(1.0, max(0.0, ratio))) / (seen_prompt + rest)
    return min(1.0, max(0.0, fraction))


@dataclass(slots=True)
class PrefillCost:
    base: float = PRIOR_BASE_S
    per_token: float = PRIOR_PER_TOKEN_S
    forget: float = 0.99
    window_s: float = 2.0
    window_requests: float = 4.0
    observations: int = 0
    # Decayed sufficient statistics of the regression (n: requests, u: uncached tokens).
    s_nn: float = 0.0
    s_nu: float = 0.0
    s_uu: float = 0.0
    s_nt: float = 0.0
    s_ut: float = 0.0
    # The counters at the start of the current window (None: no scrape yet).
    _last: tuple[float, ...] | None = None
    _window_start: float = 0.0

    def seconds(self, uncached_tokens: float) -> float:
        """Predicted prefill time of one request with this many uncached prompt tokens."""
        return self.base + self.per_token * max(0.0, uncached_tokens)

    def observe_counters(
        self,
        prefill_sum: float,
        prefill_count: float,
        prompt_tokens: float,
        prefix_hits: float,
        prefix_queries: float,
        now: float | None = None,
        observed: tuple[int, int] = (0, 0),
    ) -> None:
        """Feed one scrape's cumulative counters; a window closes once it is long enough."""
        now = time.monotonic() if now is None else now
        counters = (
            prefill_sum,
            prefill_count,
            prompt_tokens,
            prefix_hits,
            prefix_queries,
            float(observed[0]),
            float(observed[1]),
        )
        last = self._last
        if last is None or prefill_count < last[1] or prefill_sum < last[0]:
            self._last, self._window_start = counters, now  # first scrape, or a restart
            return
        dt, dn = prefill_sum - last[0], prefill_count - last[1]
        if now - self._window_start < self.window_s or dn < self.window_requests:
            return
        prompt = max(0.0, prompt_tokens - last[2])
        hit_fraction = window_hit_fraction(
            prompt,
            counters[5] - last[5],
            counters[6] - last[6],
            prefix_hits - last[3],
            prefix_queries - last[4],
        )
        self._last, self._window_start = counters, now
        self.add(dn, prompt * (1.0 - hit_fraction), dt)

    def add(self, dn: float, du: float, dt: float) -> None:
        """One interval: ``dn`` requests reached their first token, ``du`` uncached tokens
        were admitted, and their prefills took ``dt`` seconds in all."""
        decay = self.forget ** max(dn, 1.0)
        self.s_nn = self.s_nn * decay + dn * dn
        self.s_nu = self.s_nu * decay + dn * du
        self.s_uu = self.s_uu * decay + du * du
        self.s_nt = self.s_nt * decay + dn * dt
        self.s_ut = self.s_ut * decay + du * dt
        self.observations += 1
        self._solve()

    def _solve(self) -> None:
        rb = PRIOR_REQUESTS
        rc = PRIOR_REQUESTS * PRIOR_TOKENS * PRIOR_TOKENS
        a11, a12, a22 = self.s_nn + rb, self.s_nu, self.s_uu + rc
        y1 = self.s_nt + rb * PRIOR_BASE_S
        y2 = self.s_ut + rc * PRIOR_PER_TOKEN_S
        det = a11 * a22 - a12 * a12
        base = (y1 * a22 - a12 * y2) / det
        per_token = (a11 * y2 - a12 * y1) / det
        if per_token < 0:  # keep both non-negative: refit the one left free
            per_token, base = 0.0, y1 / a11
        if base < 0:
            base, per_token = 0.0, y2 / a22
        self.base, self.per_token = base, per_token
