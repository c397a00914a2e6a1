"""Scheduling plugins, registered by their ``type`` name (GIE's names where GIE has one).

Importing this package registers every built-in plugin.
"""

from infergate.epp.scheduling.plugins import (  # noqa: F401  (imported for registration)
    filters,
    latency,
    pickers,
    precise_prefix,
    prefix,
    profile_handlers,
    response_affinity,
    roles,
    sampling,
    scorers,
    testing,
)
from infergate.epp.scheduling.plugins.base import REGISTRY, Plugin, PluginContext

__all__ = ["REGISTRY", "Plugin", "PluginContext"]
