"""Scheduling: profile → filters → weighted scorers → picker, with per-plugin timing.

Built from a validated EndpointPickerConfig. Plugins that are referenced by no profile
but implement request-lifecycle hooks (prepare data, pre-request, response) still run,
as in GIE. A profile without a picker gets ``max-score-picker``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from infergate.epp.config import ConfigError, EndpointPickerConfig, validate_parameters
from infergate.epp.scheduling.plugins import REGISTRY, Plugin, PluginContext
from infergate.epp.scheduling.plugins.base import (
    Filter,
    Picker,
    PrepareData,
    PreRequest,
    ResponseComplete,
    ResponseHeaders,
    SchedulingResult,
    Scorer,
)
from infergate.epp.types import CycleState, EndpointState, InferenceRequest
from pydantic import BaseModel

log = logging.getLogger("infergate.epp.scheduling.scheduler")

PluginTimer = Callable[[Plugin, str, float], None]


@dataclass
class Profile:
    name: str
    filters: list[Filter] = field(default_factory=list)
    scorers: list[tuple[Scorer, float]] = field(default_factory=list)
    picker: Picker | None = None


class Scheduler:
    def __init__(
        self,
        plugins: dict[str, Plugin],
        profiles: list[Profile],
        timer: PluginTimer | None = None,
    ) -> None:
        self.plugins = plugins
        self.profiles = profiles
        self.timer = timer
        ordered = list(plugins.values())
        self.preparers = [p for p in ordered if isinstance(p, PrepareData)]
        self.pre_request_hooks = [p for p in ordered if isinstance(p, PreRequest)]
        self.response_header_hooks = [p for p in ordered if isinstance(p, ResponseHeaders)]
        self.response_complete_hooks = [p for p in ordered if isinstance(p, ResponseComplete)]

    @classmethod
    def from_config(
        cls, config: EndpointPickerConfig, context: PluginContext, timer: PluginTimer | None = None
    ) -> Scheduler:
        plugins: dict[str, Plugin] = {}
        for spec, params in validate_parameters(config, REGISTRY):
            name = spec.name or spec.type
            plugins[name] = _instantiate(REGISTRY[spec.type], name, params, context)
        specs = config.schedulingProfiles or []
        if not specs:  # GIE: one implicit profile with every scheduling plugin
            from infergate.epp.config import ProfilePluginRef, SchedulingProfile

            specs = [
                SchedulingProfile(
                    name="default",
                    plugins=[
                        ProfilePluginRef(pluginRef=name, weight=None)
                        for name, p in plugins.items()
                        if isinstance(p, Filter | Scorer | Picker)
                    ],
                )
            ]
        profiles: list[Profile] = []
        for i, spec_profile in enumerate(specs):
            profile = Profile(spec_profile.name)
            for j, ref in enumerate(spec_profile.plugins):
                plugin = plugins[ref.pluginRef]
                where = f"schedulingProfiles[{i}].plugins[{j}]"
                used = False
                if isinstance(plugin, Filter):
                    profile.filters.append(plugin)
                    used = True
                if isinstance(plugin, Scorer):
                    profile.scorers.append((plugin, 1.0 if ref.weight is None else ref.weight))
                    used = True
                if isinstance(plugin, Picker):
                    if profile.picker is not None:
                        raise ConfigError(
                            f"{where}: a profile has one picker; already has {profile.picker}"
                        )
                    profile.picker = plugin
                    used = True
                if not used and not isinstance(
                    plugin, PrepareData | PreRequest | ResponseHeaders | ResponseComplete
                ):
                    raise ConfigError(f"{where}: {plugin} is not a filter, scorer or picker")
            if profile.picker is None:
                from infergate.epp.scheduling.plugins.pickers import MaxScorePicker, PickerParams

                profile.picker = MaxScorePicker(
                    "max-score-picker", PickerParams(maxNumOfEndpoints=1), context
                )
            profiles.append(profile)
        return cls(plugins, profiles, timer)

    def _time(self, plugin: Plugin, point: str, started: float) -> None:
        if self.timer is not None:
            self.timer(plugin, point, time.perf_counter() - started)

    async def schedule(
        self, request: InferenceRequest, candidates: Sequence[EndpointState]
    ) -> SchedulingResult:
        """Run the (primary) profile; an empty ``targets`` means nothing can serve."""
        cycle = CycleState()
        perf = time.perf_counter
        for preparer in self.preparers:
            t = perf()
            await preparer.prepare(cycle, request, candidates)
            self._time(preparer, "prepare", t)
        profile = self.profiles[0]
        endpoints = list(candidates)
        for f in profile.filters:
            t = perf()
            endpoints = f.filter(cycle, request, endpoints)
            self._time(f, "filter", t)
            if not endpoints:
                return SchedulingResult(profile.name, [])
        totals = [0.0] * len(endpoints)
        per_scorer: dict[str, dict[str, float]] = {}
        for scorer, weight in profile.scorers:
            t = perf()
            scores = scorer.score(cycle, request, endpoints)
            self._time(scorer, "score", t)
            clamped = [0.0 if not s > 0.0 else (1.0 if s > 1.0 else s) for s in scores]
            per_scorer[scorer.name] = {e.key: s for e, s in zip(endpoints, clamped, strict=True)}
            if weight:
                totals = [a + weight * s for a, s in zip(totals, clamped, strict=True)]
        assert profile.picker is not None
        t = perf()
        targets = profile.picker.pick(cycle, request, endpoints, totals)
        self._time(profile.picker, "pick", t)
        result = SchedulingResult(
            profile.name,
            targets,
            per_scorer,
            {e.key: s for e, s in zip(endpoints, totals, strict=True)},
        )
        for hook in self.pre_request_hooks:
            t = perf()
            try:
                hook.pre_request(cycle, request, result)
            except Exception:
                log.exception("pre-request hook %s failed", hook)
            self._time(hook, "pre_request", t)
        result.prefix_hit_ratio = cycle.get("prefix.hit_ratio")
        result.prefix_hit_bytes = cycle.get("prefix.hit_bytes")
        return result

    async def start(self) -> None:
        for plugin in self.plugins.values():
            await plugin.start()

    async def stop(self) -> None:
        for plugin in self.plugins.values():
            try:
                await plugin.stop()
            except Exception:
                log.exception("stopping %s failed", plugin)


def _instantiate(cls: type[Plugin], name: str, params: BaseModel, context: PluginContext) -> Plugin:
    return cls(name, params, context)
