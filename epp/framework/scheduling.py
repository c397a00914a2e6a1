"""The scheduling interfaces: what the scheduler runs within one profile, and its result.

Per profile the scheduler runs the ``Filter`` s, then the weighted ``Scorer`` s, then the
``Picker``; a ``ProfileHandler`` decides which profiles run and combines their results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from infergate.epp.framework.plugin import Plugin
from infergate.epp.types import CycleState, EndpointState, InferenceRequest


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
    #: The cycle state this profile's plugins saw (the data preparers' values plus what
    #: its filters and scorers added); the pre-request hooks run with it.
    cycle: CycleState = field(default_factory=CycleState, repr=False, compare=False)

    @property
    def primary(self) -> EndpointState | None:
        return self.targets[0] if self.targets else None


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
