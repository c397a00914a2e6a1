"""Filters: narrow the candidate endpoints before scoring."""

from __future__ import annotations

import ipaddress
import math
import time
from collections.abc import Sequence
from typing import Protocol

from infergate.epp.scheduling.plugins.base import Filter, register
from infergate.epp.types import CycleState, EndpointState, InferenceRequest
from pydantic import BaseModel, ConfigDict, Field

TEST_SELECTION_HEADER = "test-epp-endpoint-selection"


@register
class SaturationFilter(Filter):
    """Drop saturated endpoints (long queue, full KV cache, stale metrics).

    Fails open: when every candidate is saturated it keeps them all, so load is spread
    by the scorers instead of refusing traffic that admission already let in.
    """

    type_name = "saturation-filter"

    def filter(
        self, cycle: CycleState, request: InferenceRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        detector = self.context.saturation
        now = time.monotonic()
        kept = [e for e in endpoints if not detector.is_saturated(e, now)]
        return kept or endpoints


def _normal_host(host: str) -> str:
    host = host.strip().strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _split(item: str) -> tuple[str, str]:
    """``ip``, ``ip:port``, ``[v6]:port`` → (host, port or "")."""
    item = item.strip()
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        return _normal_host(host), rest.lstrip(":")
    if item.count(":") == 1:
        host, port = item.split(":")
        return _normal_host(host), port.strip()
    return _normal_host(item), ""


@register
class HeaderBasedTestingFilter(Filter):
    """GIE conformance's filter: keep only the endpoints named in ``test-epp-endpoint-selection``.

    The header is a comma-separated list of ``ip`` or ``ip:port``; a port demands an exact
    match, a bare IP matches any port of that address. The order of the header is kept (the
    first listed endpoint is the primary). A header that names no endpoint of the pool
    leaves no candidate, which the EPP answers with 503: a test that pins another pool's
    pod must not reach this one. Without the header (or with an empty one) every endpoint
    stays, as GIE's reference conformance EPP does: several GIE tests send plain requests
    and expect any pod of the pool to answer.
    """

    type_name = "header-based-testing-filter"

    def filter(
        self, cycle: CycleState, request: InferenceRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        value = request.headers.get(TEST_SELECTION_HEADER, "")
        if not value.strip():
            return list(endpoints)
        by_host: dict[str, list[EndpointState]] = {}
        for state in endpoints:
            by_host.setdefault(_normal_host(state.endpoint.address), []).append(state)
        chosen: list[EndpointState] = []
        seen: set[str] = set()
        for item in value.split(","):
            if not item.strip():
                continue
            host, port = _split(item)
            for state in by_host.get(host, []):
                if (not port or str(state.endpoint.port) == port) and state.key not in seen:
                    seen.add(state.key)
                    chosen.append(state)
        cycle["test.selection_order"] = [s.key for s in chosen]
        return chosen


#: ``PluginContext.extras`` key of the configured latency model (the predicted-latency
#: scorer registers itself there), which the bounded-load filter may consult.
LATENCY_MODEL = "latency_model"


class LatencyModel(Protocol):
    def predict(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> list[tuple[float, float]]:
        """Per endpoint: (predicted TTFT seconds, uncached tokens)."""
        ...


def endpoint_load(state: EndpointState) -> int:
    """Requests on an endpoint, whoever sent them (:meth:`EndpointState.load`: the
    engine's last report corrected by this EPP's picks and finishes since)."""
    return state.load()


class BoundedLoadParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    loadFactor: float = Field(
        1.25,
        ge=1.0,
        description="An endpoint stays a candidate while its load is at most this many "
        "times the fair share (rounded up), plus loadSlack.",
    )
    loadSlack: int = Field(
        3,
        ge=0,
        description="Requests allowed above the scaled fair share: at low load a few "
        "requests more on a cache holder build no queue (continuous batching runs them "
        "together), so the bound only bites once the fleet is busy.",
    )
    keepCheaperHolders: bool = Field(
        False,
        description="Keep an endpoint over the bound that holds more of the request's "
        "prefix than every endpoint within it, when the predicted-latency scorer's cost "
        "model predicts an earlier first token there than on any endpoint within the "
        "bound (its queue costs less than recomputing the prefix). Without that scorer "
        "in the config this does nothing.",
    )


@register
class BoundedLoadFilter(Filter):
    """Keep only endpoints whose load is within ``loadFactor`` × the fair share.

    ``bound = ceil(loadFactor × (Σ load + 1) ÷ N) + loadSlack`` over the N candidates, the
    ``+ 1`` counting the request being placed; an endpoint with ``load ≤ bound`` stays. The
    least loaded endpoint always stays (its load is at most the mean), so the filter never
    empties the list. This is consistent hashing with bounded loads (Mirrokni, Thorup and
    Zadimoghaddam, 2018) applied to affinity routing: the scorers may still prefer the
    endpoint that holds a prefix, but no endpoint gets more than ``loadFactor`` × its share
    of the requests in flight (+ ``loadSlack``), so however sticky the scoring, the
    busiest engine's queue is bounded by a constant factor of round robin's. Affinity is kept where it is cheap
    (the holder is not overloaded) and given up exactly where it would build a queue.
    """

    type_name = "bounded-load-filter"
    Params = BoundedLoadParams

    def filter(
        self, cycle: CycleState, request: InferenceRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        if len(endpoints) < 2:
            return list(endpoints)
        loads = [endpoint_load(e) for e in endpoints]
        factor = float(self.params.loadFactor)  # type: ignore[attr-defined]
        slack = int(self.params.loadSlack)  # type: ignore[attr-defined]
        bound = math.ceil(factor * (sum(loads) + 1) / len(endpoints)) + slack
        kept = [e for e, load in zip(endpoints, loads, strict=True) if load <= bound]
        if self.params.keepCheaperHolders and len(kept) < len(endpoints):  # type: ignore[attr-defined]
            return self._with_cheaper_holders(cycle, request, endpoints, kept)
        return kept

    def _with_cheaper_holders(
        self,
        cycle: CycleState,
        request: InferenceRequest,
        endpoints: list[EndpointState],
        kept: list[EndpointState],
    ) -> list[EndpointState]:
        """``kept`` plus the removed endpoints holding more of the request's prefix than
        any kept one, where the latency model predicts them sooner than every kept one.

        A request count is a poor measure of a queue when prompts differ by 100x (a
        trace's 2k-token follow-up and its 60k-token new conversation): at 20-45
        requests on every engine the bound removed holders whose queue was shorter than
        the recompute their hit saves, and half of a bursty trace window's recomputed
        blocks were such requests (docs/benchmarks/routing.md)."""
        model: LatencyModel | None = self.context.extras.get(LATENCY_MODEL)
        if model is None:
            return kept
        cached: dict[str, float] = dict(cycle.get("prefix.cached_tokens") or {})
        for key, tokens in (cycle.get("precise.cached_tokens") or {}).items():
            cached[key] = max(cached.get(key, 0.0), float(tokens))
        best = max((cached.get(e.key, 0.0) for e in kept), default=0.0)
        inside = {e.key for e in kept}
        holders = [e for e in endpoints if e.key not in inside and cached.get(e.key, 0.0) > best]
        if not holders:
            return kept
        predicted = model.predict(cycle, request, [*kept, *holders])
        sooner = min(t for t, _ in predicted[: len(kept)])
        late = predicted[len(kept) :]
        inside |= {e.key for e, (t, _) in zip(holders, late, strict=True) if t < sooner}
        return [e for e in endpoints if e.key in inside]
