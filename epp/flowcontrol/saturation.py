"""Saturation: is an endpoint (or the pool) too loaded to take more sheddable work?

An endpoint is saturated when its waiting queue reaches the queue threshold, its KV-cache
usage reaches the KV threshold, or its metrics are stale (older than the staleness
threshold, or never scraped): with no fresh data we assume the worst. The pool is
saturated when every candidate is.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from infergate.epp.types import EndpointState
from pydantic import BaseModel, ConfigDict, Field


class SaturationConfig(BaseModel):
    """GIE's ``saturationDetector`` section of the EndpointPickerConfig."""

    model_config = ConfigDict(extra="forbid")

    queueDepthThreshold: int = Field(5, ge=0)
    kvCacheUtilThreshold: float = Field(0.8, ge=0.0, le=1.0)
    metricsStalenessThreshold: float | None = Field(
        None, gt=0, description="Seconds; defaults to --metrics-staleness-threshold."
    )


class SaturationDetector:
    def __init__(self, queue_threshold: int, kv_threshold: float, staleness: float) -> None:
        self.queue_threshold = queue_threshold
        self.kv_threshold = kv_threshold
        self.staleness = staleness

    def is_saturated(self, state: EndpointState, now: float | None = None) -> bool:
        metrics = state.metrics
        if metrics.age(time.monotonic() if now is None else now) > self.staleness:
            return True
        return metrics.waiting >= self.queue_threshold or metrics.kv_usage >= self.kv_threshold

    def is_stale(self, state: EndpointState, now: float | None = None) -> bool:
        return state.metrics.age(now) > self.staleness

    def pool_saturated(self, states: Iterable[EndpointState]) -> bool:
        now = time.monotonic()
        return all(self.is_saturated(state, now) for state in states)
