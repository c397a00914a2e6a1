"""The ``flowControl`` section of the EndpointPickerConfig (GIE's shape, our own fields).

Absent (or ``enabled: false``) means no flow control: admission stays shed-or-pass, exactly
as before this section existed. Present, every request waits in a priority band / flow
queue until the pool has capacity::

    flowControl:
      maxRequests: 10000          # all bands together
      maxBytes: 268435456         # request bodies held, all bands together
      defaultRequestTTL: 20s      # queued longer than this -> 429 (under Envoy's 30 s)
      maxRequestsPerEndpoint: 4   # dispatch budget: EPP-routed, unfinished requests
      useSaturationDetector: true # also hold while every endpoint is saturated
      dispatchInterval: 20ms      # re-check capacity this often while anything waits
      fairnessPolicy: round-robin # or token-fair-share (between flows of one band)
      maxPrefillQueueSeconds: 0.5 # dispatch while some engine has at most this prefill queued
      prefillOrderWeight: 1.0     # inside a flow, least enqueued + this x predicted prefill first
      priorityBands:              # optional per-band bounds; other bands get the defaults
      - {priority: -1, maxRequests: 5000, maxBytes: 67108864, requestTTL: 5s}

Durations accept seconds as a number or Go-style strings (``500ms``, ``30s``, ``2m``), as
GIE's config does. Unknown fields are refused by name.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: Any) -> float:
    """Seconds from a number or ``<n>(ms|s|m|h)``; raises ValueError naming the value."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match:
            return float(match.group(1)) * _UNIT[match.group(2)]
    raise ValueError(f"not a duration (seconds, or e.g. '500ms', '30s', '2m'): {value!r}")


class PriorityBandConfig(BaseModel):
    """Bounds of one priority band (the priority comes from the InferenceObjective)."""

    model_config = ConfigDict(extra="forbid")

    priority: int
    priorityName: str | None = None
    maxRequests: int | None = Field(None, ge=1)
    maxBytes: int | None = Field(None, ge=1)
    requestTTL: float | None = Field(None, gt=0, description="Overrides defaultRequestTTL.")

    @field_validator("requestTTL", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float | None:
        return None if value is None else parse_duration(value)


class FlowControlConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    maxRequests: int = Field(10_000, ge=1)
    maxBytes: int = Field(1 << 30, ge=1)
    #: Keep it under Envoy's ext_proc ``message_timeout`` (30 s in infergate's Envoy
    #: config): a request queued past that is failed by Envoy, not answered 429 by us.
    defaultRequestTTL: float = Field(20.0, gt=0)
    maxRequestsPerEndpoint: int | None = Field(None, ge=1)
    useSaturationDetector: bool = True
    dispatchInterval: float = Field(0.02, gt=0, le=5.0)
    fairnessPolicy: Literal["round-robin", "token-fair-share"] = "round-robin"
    #: Dispatch only while some endpoint's prefill queue is at most this many seconds
    #: (``controller.prefill_queue_seconds``), one request at a time.
    maxPrefillQueueSeconds: float | None = Field(None, ge=0)
    #: Inside a flow, dispatch the least ``enqueued + w x predicted prefill seconds``
    #: first (``w`` this weight; None: first come, first served).
    prefillOrderWeight: float | None = Field(None, ge=0)
    defaultBandMaxRequests: int | None = Field(None, ge=1)
    defaultBandMaxBytes: int | None = Field(None, ge=1)
    priorityBands: list[PriorityBandConfig] = Field(default_factory=list)

    @field_validator("defaultRequestTTL", "dispatchInterval", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float:
        return parse_duration(value)

    @model_validator(mode="after")
    def _check(self) -> FlowControlConfig:
        seen: set[int] = set()
        for i, band in enumerate(self.priorityBands):
            if band.priority in seen:
                raise ValueError(f"priorityBands[{i}].priority {band.priority} is repeated")
            seen.add(band.priority)
        if (
            self.maxRequestsPerEndpoint is None
            and self.maxPrefillQueueSeconds is None
            and not self.useSaturationDetector
        ):
            raise ValueError(
                "flowControl needs a capacity signal: set maxRequestsPerEndpoint or "
                "maxPrefillQueueSeconds, or keep useSaturationDetector true"
            )
        return self

    def ttl(self, priority: int) -> float:
        """Seconds a request of ``priority`` may wait before it is answered 429."""
        for band in self.priorityBands:
            if band.priority == priority and band.requestTTL is not None:
                return band.requestTTL
        return self.defaultRequestTTL

    def band(self, priority: int) -> tuple[int | None, int | None]:
        """(maxRequests, maxBytes) of the band for ``priority``; None = only the totals."""
        for band in self.priorityBands:
            if band.priority == priority:
                return band.maxRequests, band.maxBytes
        return self.defaultBandMaxRequests, self.defaultBandMaxBytes


def flow_control_config(raw: Any) -> FlowControlConfig | None:
    """The parsed section, or None when flow control is off (absent, null, enabled: false)."""
    if raw is None:
        return None
    config = raw if isinstance(raw, FlowControlConfig) else FlowControlConfig.model_validate(raw)
    return config if config.enabled else None
