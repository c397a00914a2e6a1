"""The EndpointPickerConfig an EPP gets: the built-in default or the user's, checked."""

from __future__ import annotations

from typing import Any

import yaml

# The DESIGN.md default profile, in GIE's EndpointPickerConfig shape.
DEFAULT_EPP_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: max-score-picker
"""


class InvalidEPPConfig(ValueError):
    """The user's EndpointPickerConfig would not start an EPP."""


def check_epp_config(text: str, source: str) -> None:
    """Reject a config the EPP would refuse at start-up, so the pool says so up front.

    Uses the EPP's own parser when it is importable (same distribution), else checks
    the GIE shape: a mapping of kind EndpointPickerConfig with plugins and profiles.
    """
    try:
        from infergate.epp.config import ConfigError, parse_config
    except ImportError:
        _check_shape(text, source)
        return
    try:
        parse_config(text, source)
    except ConfigError as error:
        raise InvalidEPPConfig(str(error)) from error


def _check_shape(text: str, source: str) -> None:
    try:
        raw: Any = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise InvalidEPPConfig(f"{source}: not valid YAML: {error}") from error
    if not isinstance(raw, dict):
        raise InvalidEPPConfig(f"{source}: the top level must be a mapping")
    if raw.get("kind", "EndpointPickerConfig") != "EndpointPickerConfig":
        raise InvalidEPPConfig(f"{source}: kind must be EndpointPickerConfig")
    for key in ("plugins", "schedulingProfiles"):
        if key in raw and not isinstance(raw[key], list):
            raise InvalidEPPConfig(f"{source}: {key} must be a list")
