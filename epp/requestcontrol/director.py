"""The request director: body → rewrite → objective → admission → candidates → schedule.

Scheduling here is one cycle of GIE's director: the data preparers, the scheduler's
profiles, then the pre-request hooks (:mod:`infergate.epp.requestcontrol.hooks`); the
response hooks run from ``response_headers`` and ``finish``.

Admission is shed-or-pass (sheddable requests get 429 while the pool is saturated) unless
flow control is configured; then a request with a body waits in the flow controller
until it is dispatched, is scheduled against the candidates as they are at that moment,
and gives its capacity back in ``finish`` (or at once if scheduling fails). Requests
without a body (GET /v1/models…) are not inference work and are never queued.

It owns no per-request state; the ext-proc stream does, and calls ``finish`` exactly
once for every request it routed.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from infergate.epp.compact_json import compact_json
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.datalayer.objectives import OBJECTIVE_HEADER, ObjectiveStore
from infergate.epp.flowcontrol.controller import (
    FlowController,
    FlowRejected,
    Ticket,
    fairness_id,
)
from infergate.epp.flowcontrol.saturation import SaturationDetector
from infergate.epp.framework.requestcontrol import ResponseInfo
from infergate.epp.framework.scheduling import SchedulingResult
from infergate.epp.observability import EppMetrics
from infergate.epp.requestcontrol.hooks import Hooks
from infergate.epp.requestcontrol.priority import settle_priority
from infergate.epp.requestcontrol.requests import BadRequest, parse_body
from infergate.epp.scheduling.scheduler import Scheduler
from infergate.epp.types import EndpointState, InferenceRequest

from infergate.wire.responses import ROUTE_TAG_HEADER, route_tag

log = logging.getLogger("infergate.epp.requestcontrol.director")

#: GIE's header to force the target model (wins over InferenceModelRewrite rules).
MODEL_REWRITE_HEADER = "x-gateway-model-name-rewrite"


class Rejected(Exception):
    """Answer the client directly with ``status`` (429, 503, 400…)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


@dataclass(slots=True)
class Decision:
    request: InferenceRequest
    result: SchedulingResult
    body: bytes | None  # the (possibly rewritten) body to send upstream
    body_rewritten: bool
    started: float = 0.0  # time.monotonic() when routing began
    ticket: Ticket | None = None  # flow control's claim on capacity, released in finish

    @property
    def destination(self) -> str:
        return ",".join(state.key for state in self.result.targets)


def _matches(state: EndpointState, wanted: set[str]) -> bool:
    return state.key in wanted or state.endpoint.address in wanted


class Director:
    def __init__(
        self,
        datastore: Datastore,
        scheduler: Scheduler,
        saturation: SaturationDetector,
        objectives: ObjectiveStore,
        metrics: EppMetrics,
        flow: FlowController | None = None,
    ) -> None:
        self.datastore = datastore
        self.scheduler = scheduler
        self.saturation = saturation
        self.objectives = objectives
        self.metrics = metrics
        #: None: admission is shed-or-pass (sheddable requests get 429 when the pool is
        #: saturated). Set: every request waits in flow control until it is dispatched.
        self.flow = flow
        #: Every configured plugin that implements a request-control hook, timed like the
        #: scheduler's own plugins.
        self.hooks = Hooks(scheduler.plugins.values(), scheduler.timer)

    def _candidates(self, subset: list[str] | None) -> list[EndpointState]:
        candidates = self.datastore.all()
        if subset is not None:
            wanted = {item.strip() for item in subset if item.strip()}
            candidates = [s for s in candidates if _matches(s, wanted)]
            if not candidates:
                raise Rejected(503, "no ready endpoint in the requested subset")
        if not candidates:
            raise Rejected(503, "no ready endpoint in the pool")
        return candidates

    async def _admit(
        self,
        request: InferenceRequest,
        size: int,
        subset: list[str] | None,
        arriving: list[EndpointState],
    ) -> tuple[Ticket, list[EndpointState]]:
        """Wait in flow control (ordered by the predicted prefill over ``arriving``, the
        candidates at arrival, when configured); then the candidates as they are *now*
        (the pool may have changed while the request waited), preferring endpoints under
        their budget."""
        assert self.flow is not None
        prefill = 0.0
        if self.flow.config.prefillOrderWeight is not None and self.flow.must_wait():
            prefill = await self.hooks.prefill_seconds(request, arriving)
        try:
            ticket = await self.flow.admit(
                request.priority,
                fairness_id(request.headers),
                size,
                request.max_tokens,
                prefill_seconds=prefill,
            )
        except FlowRejected as error:
            raise Rejected(429, f"{error.reason}: {error.message}") from None
        self.datastore.refresh()  # it waited: read the reports that came meanwhile
        try:
            candidates = self._candidates(subset)
        except Rejected:
            self.flow.release(ticket)
            raise
        budget = self.flow.config.maxRequestsPerEndpoint
        if budget is not None:
            under = [s for s in candidates if s.load() < budget]
            candidates = under or candidates
        return ticket, candidates

    def _prepare(self, request: InferenceRequest, raw: bytes | None) -> tuple[bytes | None, bool]:
        """Parse the body, apply the model rewrite and the pool owner's priority; the body
        to send on and whether it changed (re-encoded once, only then)."""
        body = parse_body(raw, request) if raw else None
        changed = False
        if body is not None:
            forced = request.headers.get(MODEL_REWRITE_HEADER, "").strip()
            target = forced or (self.objectives.rewrite(request.model) if request.model else "")
            if target and target != request.model:
                request.target_model = target
                body["model"] = target
                changed = True
        request.objective = request.headers.get(OBJECTIVE_HEADER, "")
        objective_priority = self.objectives.priority(request.objective)
        ceiling = self.objectives.client_priority_max
        changed |= settle_priority(request, body, objective_priority, ceiling)
        return (compact_json(body) if changed and body is not None else raw), changed

    async def route(
        self,
        request: InferenceRequest,
        raw_body: bytes | None,
        subset: list[str] | None,
    ) -> Decision:
        started = time.perf_counter()
        arrived = time.monotonic()
        try:
            body_out, rewritten = self._prepare(request, raw_body)
        except BadRequest as error:
            raise Rejected(400, str(error), error.param) from None

        self.datastore.refresh()  # the engines' newest load reports, read now
        candidates = self._candidates(subset)
        ticket: Ticket | None = None
        if self.flow is not None and raw_body:
            ticket, candidates = await self._admit(request, len(raw_body), subset, candidates)
        elif request.priority < 0 and self.saturation.pool_saturated(candidates):
            raise Rejected(429, "the pool is saturated; sheddable request dropped")

        try:
            result = await self.schedule(request, candidates)
            if not result.targets:
                raise Rejected(503, "no endpoint passed the scheduling filters")
        except BaseException:
            if ticket is not None and self.flow is not None:
                self.flow.release(ticket)
            raise
        if ticket is not None and self.flow is not None:
            self.flow.placed(ticket)  # its prefill is on an endpoint's clock now
        result.targets[0].note_pick()
        # The engine puts this tag in its response ids, so the next turn of a Responses
        # conversation can name its engine to any EPP (scheduling/plugins/response_affinity).
        result.request_headers[ROUTE_TAG_HEADER] = route_tag(result.targets[0].key)
        self.metrics.observe_pick_age(result.targets[0], time.monotonic())
        elapsed = time.perf_counter() - started
        self.metrics.scheduling_latency.observe(elapsed)
        self.metrics.gie_scheduler_duration.observe(elapsed)
        self.metrics.request_started(request.model, request.target_model or request.model)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s model=%s->%s priority=%d picked=%s scores=%s totals=%s",
                request.request_id,
                request.model,
                request.target_model,
                request.priority,
                ",".join(s.key for s in result.targets),
                json.dumps(result.scores, sort_keys=True),
                json.dumps(result.totals, sort_keys=True),
            )
        if result.prefix_hit_ratio is not None:
            self.metrics.prefix_hit_ratio.observe(result.prefix_hit_ratio)
            self.metrics.gie_prefix_hit_ratio.observe(result.prefix_hit_ratio)
        if result.prefix_hit_bytes is not None:
            self.metrics.gie_prefix_hit_bytes.observe(result.prefix_hit_bytes)
        return Decision(request, result, body_out, rewritten, arrived, ticket)

    async def schedule(
        self, request: InferenceRequest, candidates: list[EndpointState]
    ) -> SchedulingResult:
        """One scheduling cycle: data preparers → the scheduler → pre-request hooks (on a
        result with a target). No admission, no accounting: ``route`` does those."""
        cycle = await self.hooks.prepare(request, candidates)
        result = await self.scheduler.schedule(request, candidates, cycle)
        if result.targets:
            self.hooks.pre_request(request, result)
        return result

    def admitted(self, decision: Decision, prompt_tokens: int) -> None:
        """The engine's admission record: it took the request's ``prompt_tokens``-token prompt."""
        self.hooks.request_admitted(decision.request, decision.result, prompt_tokens)

    def finish(self, decision: Decision, response: ResponseInfo) -> None:
        """Release per-request accounting and run response-complete hooks (exactly once)."""
        primary = decision.result.primary
        if primary is not None:
            primary.note_done()
            if response.prompt_tokens and response.cached_tokens is not None:
                primary.completed_prompt_tokens += response.prompt_tokens
                primary.completed_cached_tokens += min(
                    response.cached_tokens, response.prompt_tokens
                )
        if decision.ticket is not None and self.flow is not None:
            used = (response.prompt_tokens or 0) + (response.completion_tokens or 0)
            self.flow.release(decision.ticket, used if response.complete and used else None)
        if response.prompt_tokens:
            self.metrics.tokens.labels("prompt").inc(response.prompt_tokens)
        if response.completion_tokens:
            self.metrics.tokens.labels("completion").inc(response.completion_tokens)
        request = decision.request
        self.metrics.request_finished(
            request.model,
            request.target_model or request.model,
            time.monotonic() - decision.started,
            response.status if response.complete else 0,
            response.prompt_tokens,
            response.completion_tokens,
        )
        self.hooks.response_complete(decision.request, decision.result, response)

    def response_headers(self, decision: Decision | None, response: ResponseInfo) -> dict[str, str]:
        request = decision.request if decision else InferenceRequest("", {})
        result = decision.result if decision else None
        return self.hooks.response_headers(request, result, response)
