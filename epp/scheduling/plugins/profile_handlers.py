"""Profile handlers (GIE's ``ProfileHandler``): which scheduling profiles run, and the answer.

* ``single-profile-handler`` — GIE's default: the one configured profile decides.
* ``pd-profile-handler`` — prefill/decode disaggregation, after llm-d's handler of the same
  name. The decode profile always runs first. Its pick's prefix-cache estimate gives the
  *uncached* part of the prompt on that endpoint::

      uncached = prompt_tokens - cached_tokens(decode pick)

  where ``prompt_tokens`` is the precise index's exact count when it has one, else the
  calibrated estimate of the approximate index (characters ÷ learned characters per
  token), and ``cached_tokens`` is the larger of the two indexes' estimates. Only when
  ``uncached > threshold`` does the prefill profile run: short prompts, and prompts the
  decode engine mostly holds already, are not worth a KV transfer. The prefill pick goes
  to the decode engine in llm-d's header ``x-prefiller-host-port`` (``host:port``); the
  decode engine then asks it to prefill and pulls the KV (engine/kv_transfer). When the
  prefill profile finds no endpoint, or picks the decode endpoint itself, the request is
  simply not disaggregated.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from infergate.epp.config import ConfigError
from infergate.epp.scheduling.plugins.base import (
    PluginContext,
    ProfileHandler,
    SchedulingResult,
    register,
)
from infergate.epp.scheduling.plugins.prefix import prompt_head
from infergate.epp.types import CycleState, InferenceRequest
from pydantic import BaseModel, ConfigDict, Field

from infergate.wire.names import PREFILL_HEADER

log = logging.getLogger("infergate.epp.scheduling.pd")

NOTE_PREFILL = "pd.prefill"


@register
class SingleProfileHandler(ProfileHandler):
    """Run the only profile; its result is the answer."""

    type_name = "single-profile-handler"

    def validate(self, profiles: Sequence[str]) -> None:
        if len(profiles) != 1:
            raise ConfigError(
                f"schedulingProfiles: {len(profiles)} profiles ({', '.join(profiles)}) need a "
                "profile handler that runs several (add `- type: pd-profile-handler` to "
                "plugins); single-profile-handler runs exactly one"
            )

    def pick(
        self,
        cycle: CycleState,
        request: InferenceRequest,
        profiles: Sequence[str],
        results: dict[str, SchedulingResult],
    ) -> list[str]:
        return [] if results else [profiles[0]]

    def process_results(
        self, cycle: CycleState, request: InferenceRequest, results: dict[str, SchedulingResult]
    ) -> SchedulingResult:
        (result,) = results.values()
        return result


class PdParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    threshold: int = Field(
        0, ge=0, description="Disaggregate only when more prompt tokens than this are uncached."
    )
    prefillProfile: str = Field("prefill", min_length=1)
    decodeProfile: str = Field("decode", min_length=1)


@register
class PdProfileHandler(ProfileHandler):
    type_name = "pd-profile-handler"
    Params = PdParams

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        p: PdParams = params  # type: ignore[assignment]
        self.p = p
        self.decisions = {"disaggregated": 0, "local": 0}
        self.metrics: Any = context.extras.get("metrics")

    def validate(self, profiles: Sequence[str]) -> None:
        missing = [n for n in (self.p.decodeProfile, self.p.prefillProfile) if n not in profiles]
        if missing:
            raise ConfigError(
                f"{self}: no scheduling profile named {', '.join(map(repr, missing))} "
                f"(defined: {', '.join(profiles) or 'none'})"
            )
        extra = [n for n in profiles if n not in (self.p.decodeProfile, self.p.prefillProfile)]
        if extra:
            raise ConfigError(f"{self}: profiles {extra} would never run")

    def uncached_tokens(self, cycle: CycleState, request: InferenceRequest, key: str) -> float:
        """Prompt tokens the endpoint ``key`` is estimated not to hold (see module doc)."""
        prompt = cycle.get("precise.tokens") or cycle.get("prefix.tokens")
        if not prompt:
            model = request.target_model or request.model
            prompt = self.context.calibration.tokens(model, prompt_head(request, 0)[1])
        cached = max(
            float((cycle.get("prefix.cached_tokens") or {}).get(key, 0.0)),
            float((cycle.get("precise.cached_tokens") or {}).get(key, 0.0)),
        )
        return max(0.0, float(prompt) - cached)

    def pick(
        self,
        cycle: CycleState,
        request: InferenceRequest,
        profiles: Sequence[str],
        results: dict[str, SchedulingResult],
    ) -> list[str]:
        decode = results.get(self.p.decodeProfile)
        if decode is None:
            return [self.p.decodeProfile]
        if self.p.prefillProfile in results or decode.primary is None:
            return []
        uncached = self.uncached_tokens(cycle, request, decode.primary.key)
        cycle["pd.uncached_tokens"] = uncached
        return [self.p.prefillProfile] if uncached > self.p.threshold else []

    def process_results(
        self, cycle: CycleState, request: InferenceRequest, results: dict[str, SchedulingResult]
    ) -> SchedulingResult:
        decode = results[self.p.decodeProfile]
        decode.profile_results = dict(results)
        prefill = results.get(self.p.prefillProfile)
        target = prefill.primary if prefill is not None else None
        if target is not None and decode.primary is not None and target.key != decode.primary.key:
            decode.request_headers[PREFILL_HEADER] = target.key
            decode.remote_prefill = True
            request.notes[NOTE_PREFILL] = target.key
            decision = "disaggregated"
        else:
            decision = "local"
        self.decisions[decision] += 1
        if self.metrics is not None:
            self.metrics.pd_decisions.labels(decision).inc()
        return decode
