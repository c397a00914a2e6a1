"""Moved to :mod:`infergate.envoy.bootstrap`; this re-export keeps branches in flight working."""

from infergate.envoy.bootstrap import *  # noqa: F403
from infergate.envoy.bootstrap import __all__  # noqa: F401
