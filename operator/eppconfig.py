"""The EndpointPickerConfig an EPP gets: the built-in default or the user's, checked."""

from __future__ import annotations

from infergate.epp.config import DEFAULT_CONFIG_YAML, ConfigError, parse_config

# The EPP's own default (predicted latency over the calibrated prefix index), so a pool
# in a cluster schedules exactly as `infergate up` does.
DEFAULT_EPP_CONFIG = DEFAULT_CONFIG_YAML


class InvalidEPPConfig(ValueError):
    """The user's EndpointPickerConfig would not start an EPP."""


def check_epp_config(text: str, source: str) -> None:
    """Reject a config the EPP would refuse at start-up (its own parser), so the pool's
    status says so up front instead of the EPP crash-looping."""
    try:
        parse_config(text, source)
    except ConfigError as error:
        raise InvalidEPPConfig(str(error)) from error
