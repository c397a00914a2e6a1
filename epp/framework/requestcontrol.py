"""The request-control interfaces: the hooks the Director runs around scheduling.

``PrepareData`` runs before the scheduler (it fills the cycle state the profiles read),
``PrefillEstimate`` before flow control queues a request that will wait (its order),
``PreRequest`` once per profile result after it, ``RequestAdmitted`` when the engine's
admission record says it took the prompt (engines that report completion records; not a
GIE extension point), ``ResponseHeaders`` when the engine's response headers arrive and
``ResponseComplete`` exactly once per routed request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from infergate.epp.framework.plugin import Plugin
from infergate.epp.framework.scheduling import SchedulingResult
from infergate.epp.types import CycleState, EndpointState, InferenceRequest


@dataclass(slots=True)
class ResponseInfo:
    """What the EPP learned from the engine's response."""

    status: int = 0
    served_endpoint: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    complete: bool = False


class PrepareData(Plugin):
    async def prepare(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> None:
        raise NotImplementedError


class PrefillEstimate(Plugin):
    def prefill_seconds(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> float:
        """The request's predicted prefill on the endpoint where it is least, in seconds,
        from a prepared cycle: what flow control orders held requests by
        (``prefillOrderWeight``). Not a GIE extension point."""
        raise NotImplementedError


class PreRequest(Plugin):
    def pre_request(
        self, cycle: CycleState, request: InferenceRequest, result: SchedulingResult
    ) -> None:
        raise NotImplementedError


class RequestAdmitted(Plugin):
    def request_admitted(
        self, request: InferenceRequest, result: SchedulingResult, prompt_tokens: int
    ) -> None:
        """The engine took the request: its prompt is ``prompt_tokens`` tokens. At most once
        per routed request, before its completion, and only from engines that publish
        admission records."""
        raise NotImplementedError


class ResponseHeaders(Plugin):
    def response_headers(
        self, request: InferenceRequest, result: SchedulingResult | None, response: ResponseInfo
    ) -> dict[str, str]:
        """Headers to add to the client's response."""
        raise NotImplementedError


class ResponseComplete(Plugin):
    def response_complete(
        self, request: InferenceRequest, result: SchedulingResult, response: ResponseInfo
    ) -> None:
        """Runs exactly once per routed request: at end of response or when the stream dies."""
        raise NotImplementedError
