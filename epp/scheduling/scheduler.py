"""Scheduling: profile handler → profiles (filters → weighted scorers → picker).

A profile handler (GIE's ``ProfileHandler``; ``single-profile-handler`` unless the config
names another among its plugins) decides which profiles run, given the results so far,
and combines them (``pd-profile-handler``: decode, then prefill for long uncached
prompts). Each profile runs on its own copy of the cycle state the Director's data
preparers filled, so one profile's scorers cannot see another's scratch values; each
result keeps its copy (``SchedulingResult.cycle``) for the pre-request hooks, which the
Director runs (:mod:`infergate.epp.requestcontrol.hooks`). Per-plugin timing throughout.

Built from a validated EndpointPickerConfig, which names every plugin of the EPP: the
scheduler instantiates them all and owns their start and stop, including plugins that are
referenced by no profile and only implement request-control hooks (they still run, as in
GIE). A profile without a picker gets ``max-score-picker``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from infergate.epp.config import ConfigError, EndpointPickerConfig, validate_parameters
from infergate.epp.framework.plugin import Plugin, PluginContext, PluginTimer
from infergate.epp.framework.requestcontrol import (
    PrepareData,
    PreRequest,
    ResponseComplete,
    ResponseHeaders,
)
from infergate.epp.framework.scheduling import (
    Filter,
    Picker,
    ProfileHandler,
    SchedulingResult,
    Scorer,
)
from infergate.epp.scheduling.plugins import REGISTRY
from infergate.epp.types import CycleState, EndpointState, InferenceRequest
from pydantic import BaseModel

log = logging.getLogger("infergate.epp.scheduling.scheduler")


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
        handler: ProfileHandler | None = None,
    ) -> None:
        self.plugins = plugins
        self.profiles = profiles
        self.by_name = {p.name: p for p in profiles}
        self.profile_names = [p.name for p in profiles]
        self.timer = timer
        ordered = list(plugins.values())
        handlers = [p for p in ordered if isinstance(p, ProfileHandler)]
        if len(handlers) > 1:
            raise ConfigError(f"plugins: one profile handler at most, got {handlers}")
        if handler is None and handlers:
            handler = handlers[0]
        if handler is None:
            raise ConfigError("no profile handler")
        handler.validate(self.profile_names)
        self.handler = handler

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
                    plugin,
                    PrepareData | PreRequest | ResponseHeaders | ResponseComplete | ProfileHandler,
                ):
                    raise ConfigError(f"{where}: {plugin} is not a filter, scorer or picker")
            if profile.picker is None:
                from infergate.epp.scheduling.plugins.pickers import (
                    DEFAULT_FALLBACK_ENDPOINTS,
                    MaxScorePicker,
                    PickerParams,
                )

                profile.picker = MaxScorePicker(
                    "max-score-picker",
                    PickerParams(maxNumOfEndpoints=DEFAULT_FALLBACK_ENDPOINTS),
                    context,
                )
            profiles.append(profile)
        handler = next((p for p in plugins.values() if isinstance(p, ProfileHandler)), None)
        if handler is None:
            from infergate.epp.scheduling.plugins.profile_handlers import SingleProfileHandler

            handler = SingleProfileHandler(
                "single-profile-handler", SingleProfileHandler.Params(), context
            )
        return cls(plugins, profiles, timer, handler)

    def _time(self, plugin: Plugin, point: str, started: float) -> None:
        if self.timer is not None:
            self.timer(plugin, point, time.perf_counter() - started)

    async def schedule(
        self,
        request: InferenceRequest,
        candidates: Sequence[EndpointState],
        cycle: CycleState | None = None,
    ) -> SchedulingResult:
        """Run the profiles the handler picks; an empty primary ``targets`` means nothing
        can serve.

        ``cycle`` holds what the data preparers computed for this request (empty when
        None). When several profiles ran, the primary result's ``profile_results`` lists
        them all, so the Director can run the pre-request hooks on each.
        """
        cycle = CycleState() if cycle is None else cycle
        perf = time.perf_counter
        results: dict[str, SchedulingResult] = {}
        for _ in range(len(self.profiles)):  # each profile runs at most once
            t = perf()
            names = self.handler.pick(cycle, request, self.profile_names, results)
            self._time(self.handler, "pick_profiles", t)
            names = [n for n in names if n not in results]
            if not names:
                break
            for name in names:
                results[name] = self._run_profile(
                    self.by_name[name], CycleState(cycle), request, candidates
                )
        t = perf()
        result = self.handler.process_results(cycle, request, results)
        self._time(self.handler, "process_results", t)
        if len(results) > 1 and not result.profile_results:
            result.profile_results = dict(results)
        return result

    def _run_profile(
        self,
        profile: Profile,
        cycle: CycleState,
        request: InferenceRequest,
        candidates: Sequence[EndpointState],
    ) -> SchedulingResult:
        perf = time.perf_counter
        endpoints = list(candidates)
        for f in profile.filters:
            t = perf()
            endpoints = f.filter(cycle, request, endpoints)
            self._time(f, "filter", t)
            if not endpoints:
                return SchedulingResult(profile.name, [], cycle=cycle)
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
        return SchedulingResult(
            profile.name,
            targets,
            per_scorer,
            {e.key: s for e, s in zip(endpoints, totals, strict=True)},
            cycle=cycle,
        )

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
