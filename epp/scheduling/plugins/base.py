"""Plugin kinds and the type-name registry.

A plugin is a class with a ``type_name`` and a pydantic ``Params`` model (unknown
parameters are errors, so a typo in a config names the field). It takes part in one or
more extension points by subclassing the matching base: ``Filter``, ``Scorer``,
``Picker``, and the request-lifecycle hooks ``PrepareData``, ``PreRequest``,
``ResponseHeaders``, ``ResponseComplete``. Plugins with background work (sockets, tasks)
implement ``start``/``stop``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from infergate.epp.datalayer.calibration import TokenCalibration
from infergate.epp.types import CycleState, EndpointState, InferenceRequest
from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from infergate.epp.datalayer.datastore import Datastore
    from infergate.epp.flowcontrol.saturation import SaturationDetector


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass
class PluginContext:
    """What a plugin may use from the running EPP."""

    datastore: Datastore
    saturation: SaturationDetector
    extras: dict[str, Any] = field(default_factory=dict)
    #: Characters per token per model, learned from responses (shared by every plugin).
    calibration: TokenCalibration = field(default_factory=TokenCalibration)


class Plugin:
    type_name: ClassVar[str] = ""
    Params: ClassVar[type[BaseModel]] = NoParams

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        self.name = name
        self.params = params
        self.context = context

    async def start(self) -> None:
        """Start background work (called once the event loop runs)."""

    async def stop(self) -> None:
        """Stop background work; must be idempotent."""

    def __repr__(self) -> str:
        return f"{self.type_name}/{self.name}"


@dataclass(slots=True)
class SchedulingResult:
    """A profile's decision: endpoints in preference order (primary first) and why."""

    profile: str
    targets: list[EndpointState]
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # scorer -> key -> score
    totals: dict[str, float] = field(default_factory=dict)
    prefix_hit_ratio: float | None = None
    prefix_hit_bytes: int | None = None
    #: Every profile's result by profile name (this one included) when a profile
    #: handler ran several (P/D); empty for a single profile.
    profile_results: dict[str, SchedulingResult] = field(default_factory=dict)
    #: Headers the EPP adds to the request it sends upstream (e.g. P/D's prefill pick).
    request_headers: dict[str, str] = field(default_factory=dict)
    #: True when another endpoint prefills this request (its primary only decodes).
    remote_prefill: bool = False

    @property
    def primary(self) -> EndpointState | None:
        return self.targets[0] if self.targets else None


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


class Filter(Plugin):
    def filter(
        self, cycle: CycleState, request: InferenceRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        raise NotImplementedError


class Scorer(Plugin):
    def score(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> list[float]:
        """One score in [0, 1] per endpoint, aligned with ``endpoints``."""
        raise NotImplementedError


class Picker(Plugin):
    def pick(
        self,
        cycle: CycleState,
        request: InferenceRequest,
        endpoints: Sequence[EndpointState],
        scores: Sequence[float],
    ) -> list[EndpointState]:
        raise NotImplementedError


class ProfileHandler(Plugin):
    """Decides which scheduling profiles run for a request and combines their results.

    GIE's ProfileHandler: the scheduler calls :meth:`pick` with the results so far until it
    returns no profile that has not run yet, then :meth:`process_results` once.
    """

    def validate(self, profiles: Sequence[str]) -> None:
        """Raise ``ConfigError`` when the configured profiles cannot work with this handler."""

    def pick(
        self,
        cycle: CycleState,
        request: InferenceRequest,
        profiles: Sequence[str],
        results: dict[str, SchedulingResult],
    ) -> list[str]:
        raise NotImplementedError

    def process_results(
        self, cycle: CycleState, request: InferenceRequest, results: dict[str, SchedulingResult]
    ) -> SchedulingResult:
        """The primary result (where the request goes), carrying the others."""
        raise NotImplementedError


class PrepareData(Plugin):
    async def prepare(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> None:
        raise NotImplementedError


class PreRequest(Plugin):
    def pre_request(
        self, cycle: CycleState, request: InferenceRequest, result: SchedulingResult
    ) -> None:
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


REGISTRY: dict[str, type[Plugin]] = {}


def register(cls: type[Plugin]) -> type[Plugin]:
    if not cls.type_name or cls.type_name in REGISTRY:
        raise ValueError(f"plugin type {cls.type_name!r} is empty or registered twice")
    REGISTRY[cls.type_name] = cls
    return cls


def minmax_inverse(values: Sequence[float]) -> list[float]:
    """Lower is better: map the smallest value to 1 and the largest to 0 (all equal → 1)."""
    if not values:
        return []
    low = min(values)
    high = max(values)
    if high == low:
        return [1.0] * len(values)
    span = high - low
    return [(high - v) / span for v in values]
