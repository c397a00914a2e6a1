"""What the scheduling plugins share: their interfaces, the registry and small helpers.

The interfaces are defined in :mod:`infergate.epp.framework` (below both the scheduler
and the Director) and re-exported here, where the plugins import them. A plugin that
also takes part in request control subclasses the hooks of
:mod:`infergate.epp.framework.requestcontrol` (``PrepareData``, ``PreRequest``,
``ResponseHeaders``, ``ResponseComplete``); the Director runs those, the scheduler runs
filters, scorers, pickers and the profile handler.
"""

from __future__ import annotations

from collections.abc import Sequence

from infergate.epp.framework.plugin import REGISTRY, NoParams, Plugin, PluginContext, register
from infergate.epp.framework.scheduling import (
    Filter,
    Picker,
    ProfileHandler,
    SchedulingResult,
    Scorer,
)

__all__ = [
    "REGISTRY",
    "Filter",
    "NoParams",
    "Picker",
    "Plugin",
    "PluginContext",
    "ProfileHandler",
    "SchedulingResult",
    "Scorer",
    "minmax_inverse",
    "register",
]


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
