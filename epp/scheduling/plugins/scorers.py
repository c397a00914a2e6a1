"""Load-aware scorers: each maps endpoints to [0, 1], higher is better."""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Sequence

from infergate.epp.framework.requestcontrol import (
    PreRequest,
    ResponseComplete,
    ResponseHeaders,
    ResponseInfo,
)
from infergate.epp.scheduling.plugins.base import (
    PluginContext,
    SchedulingResult,
    Scorer,
    minmax_inverse,
    register,
)
from infergate.epp.types import CycleState, EndpointState, InferenceRequest
from pydantic import BaseModel, ConfigDict, Field


@register
class QueueScorer(Scorer):
    """Shorter waiting queue is better, min-max normalised across the candidates."""

    type_name = "queue-scorer"

    def score(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> list[float]:
        return minmax_inverse([e.metrics.waiting for e in endpoints])


@register
class RunningRequestsScorer(Scorer):
    """Fewer running requests (engine-reported) is better, min-max normalised."""

    type_name = "running-requests-scorer"

    def score(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> list[float]:
        return minmax_inverse([e.metrics.running for e in endpoints])


@register
class KVCacheUtilizationScorer(Scorer):
    """Free KV cache is better: score = 1 - usage."""

    type_name = "kv-cache-utilization-scorer"

    def score(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> list[float]:
        return [min(1.0, max(0.0, 1.0 - e.metrics.kv_usage)) for e in endpoints]


class TokenLoadParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    charactersPerToken: float = Field(4.0, gt=0)


@register
class TokenLoadScorer(Scorer, PreRequest, ResponseComplete):
    """Fewer EPP-side in-flight tokens is better.

    The EPP adds each routed request's estimated tokens (prompt estimate plus
    ``max_tokens`` when given) to its endpoint at pre-request and removes them when the
    response completes, so it reacts before the next metrics scrape does.
    """

    type_name = "token-load-scorer"
    Params = TokenLoadParams

    def score(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> list[float]:
        loads = [e.in_flight_tokens for e in endpoints]
        high = max(loads, default=0)
        if high == 0:
            return [1.0] * len(loads)
        return [1.0 - load / high for load in loads]

    def _tokens(self, request: InferenceRequest) -> int:
        return request.prompt_tokens_estimate + (request.max_tokens or 0)

    def pre_request(
        self, cycle: CycleState, request: InferenceRequest, result: SchedulingResult
    ) -> None:
        if result.primary is not None:
            result.primary.in_flight_tokens += self._tokens(request)

    def response_complete(
        self, request: InferenceRequest, result: SchedulingResult, response: ResponseInfo
    ) -> None:
        state = result.primary
        if state is not None:
            state.in_flight_tokens = max(0, state.in_flight_tokens - self._tokens(request))


#: Adapter names remembered per LoRA scorer (bounded: a fleet serves far fewer).
MAX_KNOWN_ADAPTERS = 10_000


@register
class LoraAffinityScorer(Scorer):
    """Prefer servers with the request's adapter active, then those with room to load it.

    Neutral (every candidate 1.0) unless the request is for an adapter: some candidate
    reports adapter slots (``vllm:lora_requests_info``'s ``max_lora``) and the model is an
    adapter some endpoint has reported running or waiting. So the scorer can sit in the
    default profile: on a fleet without adapters, or for base-model requests, it changes
    nothing. (An adapter no engine has loaded yet is new to the EPP too; its first request
    is routed on the other scorers, and it is known from the next report on.)
    """

    type_name = "lora-affinity-scorer"

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self._adapters: set[str] = set()

    def _is_adapter(self, model: str, endpoints: Sequence[EndpointState]) -> bool:
        if not any(e.metrics.max_active_models > 0 for e in endpoints):
            return False
        for e in endpoints:
            for name in e.metrics.active_models | e.metrics.waiting_models:
                if len(self._adapters) < MAX_KNOWN_ADAPTERS:
                    self._adapters.add(name)
        return model in self._adapters

    def score(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> list[float]:
        model = request.target_model
        if not self._is_adapter(model, endpoints):
            return [1.0] * len(endpoints)
        scores: list[float] = []
        for e in endpoints:
            m = e.metrics
            if model in m.active_models:
                scores.append(1.0)
            elif len(m.active_models) + len(m.waiting_models) < m.max_active_models:
                scores.append(0.8)
            elif model in m.waiting_models:
                scores.append(0.6)
            else:
                scores.append(0.0)
        return scores


@register
class NoHitLRUScorer(Scorer, PreRequest):
    """Spread cache-cold requests: prefer the endpoint that least recently took one.

    A request is cold when the prefix scorer (run earlier in the cycle) found no cached
    block anywhere. Cold requests score never-used endpoints 1.0 and the rest by how long
    ago they last took a cold request; warm requests get a neutral 0.5 so the prefix
    scorer decides.
    """

    type_name = "no-hit-lru-scorer"

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self._last_cold: dict[str, float] = {}

    @staticmethod
    def _cold(cycle: CycleState) -> bool:
        return not cycle.get("prefix.max_match", 0)

    def score(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> list[float]:
        if not self._cold(cycle):
            return [0.5] * len(endpoints)
        stamps = [self._last_cold.get(e.key) for e in endpoints]
        used = [s for s in stamps if s is not None]
        if not used:
            return [1.0] * len(endpoints)
        oldest, newest = min(used), max(used)
        span = newest - oldest
        scores = []
        for s in stamps:
            if s is None:
                scores.append(1.0)
            elif span == 0:
                scores.append(0.0 if len(used) == len(stamps) else 0.5)
            else:
                scores.append(0.9 * (newest - s) / span)
        return scores

    def pre_request(
        self, cycle: CycleState, request: InferenceRequest, result: SchedulingResult
    ) -> None:
        if self._cold(cycle) and result.primary is not None:
            self._last_cold[result.primary.key] = time.monotonic()
        if len(self._last_cold) > 4 * max(1, len(self.context.datastore)):
            live = {s.key for s in self.context.datastore.all()}
            self._last_cold = {k: v for k, v in self._last_cold.items() if k in live}


class SessionAffinityParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    headerName: str = "x-session-token"


@register
class SessionAffinityScorer(Scorer, ResponseHeaders):
    """Keep a session on the endpoint that served it before.

    The response carries ``x-session-token`` (the serving endpoint, base64); a client that
    sends it back scores that endpoint 1 and the others 0.
    """

    type_name = "session-affinity-scorer"
    Params = SessionAffinityParams

    def _header(self) -> str:
        return str(self.params.headerName).lower()  # type: ignore[attr-defined]

    def score(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> list[float]:
        token = request.headers.get(self._header(), "")
        try:
            wanted = base64.urlsafe_b64decode(token.encode()).decode() if token else ""
        except (binascii.Error, UnicodeDecodeError, ValueError):
            wanted = ""
        return [1.0 if wanted and e.key == wanted else 0.0 for e in endpoints]

    def response_headers(
        self, request: InferenceRequest, result: SchedulingResult | None, response: ResponseInfo
    ) -> dict[str, str]:
        served = response.served_endpoint or (
            result.primary.key if result and result.primary else ""
        )
        if not served:
            return {}
        return {self._header(): base64.urlsafe_b64encode(served.encode()).decode()}
