"""The plugin base class, what a plugin may use from the running EPP, and the registry.

A plugin is a class with a ``type_name`` and a pydantic ``Params`` model (unknown
parameters are errors, so a typo in a config names the field). It takes part in one or
more extension points by subclassing the matching interfaces
(:mod:`~infergate.epp.framework.scheduling`, :mod:`~infergate.epp.framework.requestcontrol`).
Plugins with background work (sockets, tasks) implement ``start``/``stop``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from infergate.epp.datalayer.calibration import TokenCalibration
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


#: Reports how long one plugin took at one extension point (plugin, point, seconds).
PluginTimer = Callable[[Plugin, str, float], None]

REGISTRY: dict[str, type[Plugin]] = {}


def register(cls: type[Plugin]) -> type[Plugin]:
    if not cls.type_name or cls.type_name in REGISTRY:
        raise ValueError(f"plugin type {cls.type_name!r} is empty or registered twice")
    REGISTRY[cls.type_name] = cls
    return cls
