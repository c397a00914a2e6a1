"""What a prefill costs on one endpoint, learned online from the engine's own counters.

Model (a straight line per endpoint, fitted by ridge-regularised least squares)::

    prefill_seconds(request) = base + per_token × uncached_prompt_tokens

``base`` is the step the request waits for its first token even when every prompt token
is cached; ``per_token`` is the marginal compute of one uncached prompt token.

The observations are the differences between two scrapes of vLLM's counters:
``Δt`` = Δ ``vllm:request_prefill_time_seconds_sum``, ``Δn`` = Δ its ``_count``, and
``Δu`` = Δ ``vllm:prompt_tokens_total`` − Δ ``vllm:prefix_cache_hits_total``. Each
scrape interval contributes one equation ``Δt ≈ base·Δn + per_token·Δu``; the fit
minimises ``Σ w_i (Δt_i − base·Δn_i − per_token·Δu_i)² + ρ_b (base − b₀)² +
ρ_c (per_token − c₀)²``, where the weights decay by ``forget`` per finished request (the
recent ~``1/(1−forget)`` requests dominate, so a slower or busier engine is noticed) and
the ridge terms pull an endpoint with little traffic toward the prior.

The engine counts prompt tokens at admission but prefill time at completion, so one
interval's ``Δu`` and ``Δn`` belong to slightly different requests; over many intervals
the mismatch averages out, which is why the fit uses sums, never single intervals.
Because each engine has its own fit, a fleet where one engine is twice as slow learns
that, and the predicted-latency scorer routes accordingly.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Priors: 10 ms per prefill step and 50 µs per uncached prompt token (an 8B model on one
#: modern GPU is 20-60 µs); ``PRIOR_REQUESTS`` requests' worth of confidence.
PRIOR_BASE_S = 0.010
PRIOR_PER_TOKEN_S = 50e-6
PRIOR_REQUESTS = 4.0
PRIOR_TOKENS = 1000.0


@dataclass(slots=True)
class PrefillCost:
    base: float = PRIOR_BASE_S
    per_token: float = PRIOR_PER_TOKEN_S
    forget: float = 0.99
    observations: int = 0
    # Decayed sufficient statistics of the regression (n: requests, u: uncached tokens).
    s_nn: float = 0.0
    s_nu: float = 0.0
    s_uu: float = 0.0
    s_nt: float = 0.0
    s_ut: float = 0.0
    # The last counters seen (None: no scrape yet).
    _last: tuple[float, float, float, float] | None = None

    def seconds(self, uncached_tokens: float) -> float:
        """Predicted prefill time of one request with this many uncached prompt tokens."""
        return self.base + self.per_token * max(0.0, uncached_tokens)

    def observe_counters(
        self, prefill_sum: float, prefill_count: float, prompt_tokens: float, prefix_hits: float
    ) -> None:
        """Feed one scrape's cumulative counters; the first scrape only sets the baseline."""
        now = (prefill_sum, prefill_count, prompt_tokens, prefix_hits)
        last, self._last = self._last, now
        if last is None:
            return
        dt, dn = prefill_sum - last[0], prefill_count - last[1]
        du = (prompt_tokens - last[2]) - (prefix_hits - last[3])
        if dn < 0 or dt < 0 or du < 0:  # the engine restarted: counters reset
            return
        if dn == 0 and du == 0:
            return
        self.add(dn, du, dt)

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
