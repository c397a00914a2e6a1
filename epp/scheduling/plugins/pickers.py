"""Pickers: turn weighted scores into an ordered list of endpoints (primary first)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from infergate.epp.scheduling.plugins.base import Picker, register
from infergate.epp.types import CycleState, EndpointState, InferenceRequest
from pydantic import BaseModel, ConfigDict, Field

#: How many endpoints infergate's own defaults return (the built-in configs' picker, and
#: the picker of a profile that names none): the primary and, in score order, fallbacks
#: for the gateway's retries. One more than the generated Envoy config's retries
#: (``build_envoy_config``'s ``fallback_retries``, 3), so a pick whose engine died since
#: its last metrics scrape (connection refused) is absorbed by the next endpoint, not
#: retried against the same dead host. An explicitly configured picker keeps GIE's
#: default of 1 unless its parameters say otherwise.
DEFAULT_FALLBACK_ENDPOINTS = 4


class PickerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    maxNumOfEndpoints: int = Field(
        1, ge=1, description="How many endpoints to return; the rest are Envoy's fallbacks."
    )


def _count(picker: Picker) -> int:
    return int(picker.params.maxNumOfEndpoints)  # type: ignore[attr-defined]


@register
class MaxScorePicker(Picker):
    """Highest total score wins; ties are broken at random so equal endpoints share load."""

    type_name = "max-score-picker"
    Params = PickerParams

    def pick(
        self,
        cycle: CycleState,
        request: InferenceRequest,
        endpoints: Sequence[EndpointState],
        scores: Sequence[float],
    ) -> list[EndpointState]:
        order = cycle.get("test.selection_order")
        if order:  # the conformance header names the order explicitly
            rank = {key: i for i, key in enumerate(order)}
            ranked = sorted(endpoints, key=lambda e: rank.get(e.key, len(rank)))
            return ranked[: _count(self)]
        n = _count(self)
        if n == 1:
            best = max(scores, default=0.0)
            top = [e for e, s in zip(endpoints, scores, strict=True) if s == best]
            return [random.choice(top)] if top else []
        paired = list(zip(endpoints, scores, strict=True))
        random.shuffle(paired)
        paired.sort(key=lambda pair: pair[1], reverse=True)  # stable: shuffle breaks ties
        return [e for e, _ in paired[:n]]


@register
class RandomPicker(Picker):
    """Uniformly random, ignoring scores."""

    type_name = "random-picker"
    Params = PickerParams

    def pick(
        self,
        cycle: CycleState,
        request: InferenceRequest,
        endpoints: Sequence[EndpointState],
        scores: Sequence[float],
    ) -> list[EndpointState]:
        return random.sample(list(endpoints), min(_count(self), len(endpoints)))


@register
class WeightedRandomPicker(Picker):
    """Random with probability proportional to score (A-Res sampling without replacement).

    Endpoints scoring 0 are only chosen when every endpoint scores 0.
    """

    type_name = "weighted-random-picker"
    Params = PickerParams

    def pick(
        self,
        cycle: CycleState,
        request: InferenceRequest,
        endpoints: Sequence[EndpointState],
        scores: Sequence[float],
    ) -> list[EndpointState]:
        n = min(_count(self), len(endpoints))
        if not any(s > 0 for s in scores):
            return random.sample(list(endpoints), n)
        keyed = [
            (random.random() ** (1.0 / s), e)
            for e, s in zip(endpoints, scores, strict=True)
            if s > 0
        ]
        keyed.sort(key=lambda pair: pair[0], reverse=True)
        return [e for _, e in keyed[:n]]
