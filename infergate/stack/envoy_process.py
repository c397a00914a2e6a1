"""Moved to :mod:`infergate.envoy.process`; this re-export keeps branches in flight working."""

from infergate.envoy.process import envoy_argv, start_envoy, validate_config, write_config

__all__ = ["envoy_argv", "start_envoy", "validate_config", "write_config"]
