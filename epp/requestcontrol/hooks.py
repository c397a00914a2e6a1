"""The request-control hooks of one EPP, grouped by extension point, and how each runs.

The Director runs them around scheduling, as GIE's director does: the data preparers
before the scheduler (they fill the cycle state its profiles read), the pre-request hooks
after it — once per profile result that has a target, the secondary profiles' first, so
that request notes end up describing the primary — and the response hooks as the
response arrives and ends. A failing pre-request or response hook is logged and skipped;
a failing data preparer fails the request (its scorers would read nothing).

The hook plugins are the scheduler's plugins that implement the interfaces of
:mod:`infergate.epp.framework.requestcontrol`, referenced by a profile or not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from infergate.epp.framework.plugin import Plugin, PluginTimer
from infergate.epp.framework.requestcontrol import (
    PrefillEstimate,
    PrepareData,
    PreRequest,
    RequestAdmitted,
    ResponseComplete,
    ResponseHeaders,
    ResponseInfo,
)
from infergate.epp.framework.scheduling import SchedulingResult
from infergate.epp.types import CycleState, EndpointState, InferenceRequest

log = logging.getLogger("infergate.epp.requestcontrol.hooks")


class Hooks:
    def __init__(self, plugins: Iterable[Plugin], timer: PluginTimer | None = None) -> None:
        ordered = list(plugins)
        self.preparers = [p for p in ordered if isinstance(p, PrepareData)]
        self.prefill_estimates = [p for p in ordered if isinstance(p, PrefillEstimate)]
        self.pre_request_hooks = [p for p in ordered if isinstance(p, PreRequest)]
        self.admitted_hooks = [p for p in ordered if isinstance(p, RequestAdmitted)]
        self.response_header_hooks = [p for p in ordered if isinstance(p, ResponseHeaders)]
        self.response_complete_hooks = [p for p in ordered if isinstance(p, ResponseComplete)]
        self.timer = timer

    def _time(self, plugin: Plugin, point: str, started: float) -> None:
        if self.timer is not None:
            self.timer(plugin, point, time.perf_counter() - started)

    async def prepare(
        self, request: InferenceRequest, candidates: Sequence[EndpointState]
    ) -> CycleState:
        """A fresh cycle state, filled by every data preparer in config order."""
        cycle = CycleState()
        for preparer in self.preparers:
            t = time.perf_counter()
            await preparer.prepare(cycle, request, candidates)
            self._time(preparer, "prepare", t)
        return cycle

    async def prefill_seconds(
        self, request: InferenceRequest, candidates: Sequence[EndpointState]
    ) -> float:
        """The request's least predicted prefill over ``candidates`` (a cycle prepared for
        it alone, then dropped); 0 when no plugin estimates one."""
        if not self.prefill_estimates:
            return 0.0
        cycle = await self.prepare(request, candidates)
        estimate = self.prefill_estimates[0]
        t = time.perf_counter()
        seconds = estimate.prefill_seconds(cycle, request, candidates)
        self._time(estimate, "prefill_seconds", t)
        return seconds

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        """Run the pre-request hooks on each profile result with its own cycle state, then
        copy the primary's prefix-hit figures onto ``result`` (for the EPP's metrics)."""
        others = [r for r in result.profile_results.values() if r is not result]
        for profile in [*others, result]:
            if profile.targets:
                self._pre_request(profile.cycle, request, profile)
        result.prefix_hit_ratio = result.cycle.get("prefix.hit_ratio")
        result.prefix_hit_bytes = result.cycle.get("prefix.hit_bytes")

    def _pre_request(
        self, cycle: CycleState, request: InferenceRequest, result: SchedulingResult
    ) -> None:
        for hook in self.pre_request_hooks:
            t = time.perf_counter()
            try:
                hook.pre_request(cycle, request, result)
            except Exception:
                log.exception("pre-request hook %s failed", hook)
            self._time(hook, "pre_request", t)

    def response_headers(
        self, request: InferenceRequest, result: SchedulingResult | None, response: ResponseInfo
    ) -> dict[str, str]:
        """The headers every response-header hook adds to the client's response."""
        headers: dict[str, str] = {}
        for hook in self.response_header_hooks:
            try:
                headers.update(hook.response_headers(request, result, response))
            except Exception:
                log.exception("response-header hook %s failed", hook)
        return headers

    def request_admitted(
        self, request: InferenceRequest, result: SchedulingResult, prompt_tokens: int
    ) -> None:
        for hook in self.admitted_hooks:
            try:
                hook.request_admitted(request, result, prompt_tokens)
            except Exception:
                log.exception("request-admitted hook %s failed", hook)

    def response_complete(
        self, request: InferenceRequest, result: SchedulingResult, response: ResponseInfo
    ) -> None:
        for hook in self.response_complete_hooks:
            try:
                hook.response_complete(request, result, response)
            except Exception:
                log.exception("response-complete hook %s failed", hook)
