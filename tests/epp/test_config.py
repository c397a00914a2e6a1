"""EndpointPickerConfig validation: good configs build, bad ones name the field."""

from __future__ import annotations

import pytest
from infergate.epp.config import (
    BUILTIN_CONFIGS,
    DEFAULT_CONFIG_YAML,
    GIE_DEFAULT_CONFIG_YAML,
    ConfigError,
    load_config,
    parse_config,
)
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.flowcontrol.saturation import SaturationDetector
from infergate.epp.requestcontrol.hooks import Hooks
from infergate.epp.scheduling.plugins import PluginContext
from infergate.epp.scheduling.scheduler import Scheduler


def build(text: str) -> Scheduler:
    context = PluginContext(Datastore(), SaturationDetector(5, 0.8, 2.0))
    return Scheduler.from_config(parse_config(text), context)


def test_default_profile_is_predicted_latency_fed_by_the_prefix_index() -> None:
    scheduler = build(DEFAULT_CONFIG_YAML)
    (profile,) = scheduler.profiles
    weights = {scorer.type_name: weight for scorer, weight in profile.scorers}
    # LoRA affinity is neutral unless a request is for an adapter (test_routing_model.py);
    # response affinity keeps only the holder of a named previous response
    # (test_responses_routing.py). No request-count bound since the trace family
    # (docs/benchmarks/routing.md); the filter is still a plugin (test_routing_model.py).
    assert weights == {"predicted-latency-scorer": 1, "lora-affinity-scorer": 2}
    assert [f.type_name for f in profile.filters] == [
        "response-affinity-filter",
        "candidate-sampling-filter",
    ]
    # The prefix index is in no profile but still runs its lifecycle hooks.
    hooks = Hooks(scheduler.plugins.values())
    assert [p.type_name for p in hooks.preparers] == ["prefix-cache-scorer"]
    assert "prefix-cache-scorer" in [p.type_name for p in hooks.response_complete_hooks]
    assert profile.picker is not None and profile.picker.type_name == "max-score-picker"


def test_gie_default_profile_by_name() -> None:
    scheduler = build(GIE_DEFAULT_CONFIG_YAML)
    (profile,) = scheduler.profiles
    weights = {scorer.type_name: weight for scorer, weight in profile.scorers}
    assert weights == {
        "queue-scorer": 2,
        "kv-cache-utilization-scorer": 2,
        "prefix-cache-scorer": 3,
    }
    assert load_config("builtin:gie-default") == parse_config(GIE_DEFAULT_CONFIG_YAML)
    assert set(BUILTIN_CONFIGS) >= {"infergate-default", "gie-default", "precise-prefix"}
    with pytest.raises(ConfigError, match=r"no built-in config .nope.*gie-default"):
        load_config("builtin:nope")


def test_gie_conformance_config_builds_with_implicit_picker() -> None:
    scheduler = build(
        """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: header-based-testing-filter
- type: destination-endpoint-served-verifier
schedulingProfiles:
- name: conformance-profile
  plugins:
  - pluginRef: header-based-testing-filter
"""
    )
    (profile,) = scheduler.profiles
    assert [f.type_name for f in profile.filters] == ["header-based-testing-filter"]
    assert profile.picker is not None and profile.picker.type_name == "max-score-picker"
    hooks = Hooks(scheduler.plugins.values())
    assert [h.type_name for h in hooks.response_header_hooks] == [
        "destination-endpoint-served-verifier"
    ]


def test_no_profiles_means_one_profile_with_every_scheduling_plugin() -> None:
    scheduler = build(
        "kind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\n- type: random-picker\n"
    )
    (profile,) = scheduler.profiles
    assert [s.type_name for s, _ in profile.scorers] == ["queue-scorer"]
    assert profile.picker is not None and profile.picker.type_name == "random-picker"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("kind: EndpointPickerConfig\nplugins:\n- type: no-such-plugin\n", "plugins[0].type"),
        (
            "kind: EndpointPickerConfig\nplugins:\n- type: prefix-cache-scorer\n  parameters: {blockSize: x}\n",
            "plugins[0].parameters.blockSize",
        ),
        (
            "kind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\n  parameters: {typo: 1}\n",
            "plugins[0].parameters.typo",
        ),
        (
            "kind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\nschedulingProfiles:\n"
            "- name: p\n  plugins:\n  - pluginRef: missing\n",
            "schedulingProfiles[0].plugins[0].pluginRef",
        ),
        (
            "kind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\nschedulingProfiles:\n"
            "- name: p\n  plugins:\n  - {pluginRef: queue-scorer, weight: -1}\n",
            "schedulingProfiles[0].plugins[0].weight",
        ),
        ("kind: Deployment\n", "kind must be EndpointPickerConfig"),
        ("kind: EndpointPickerConfig\nunknownSection: 1\n", "unknownSection"),
        (
            "kind: EndpointPickerConfig\nsaturationDetector: {kvCacheUtilThreshold: 2}\n",
            "saturationDetector.kvCacheUtilThreshold",
        ),
        ("- just\n- a list\n", "top level must be a mapping"),
        ("plugins: [\n", "not valid YAML"),
        (
            "kind: EndpointPickerConfig\nplugins:\n- type: random-picker\n- type: max-score-picker\n"
            "schedulingProfiles:\n- name: p\n  plugins:\n  - pluginRef: random-picker\n  - pluginRef: max-score-picker\n",
            "schedulingProfiles[0].plugins[1]",
        ),
        (
            "kind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\n- type: queue-scorer\n",
            "defined twice",
        ),
    ],
)
def test_bad_configs_name_the_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        build(text)
    assert field in str(info.value)


def test_infergates_defaults_name_fallbacks_for_every_envoy_retry() -> None:
    """The default config's picker, and the picker a profile gets when it names none,
    return the primary plus fallbacks: one endpoint per attempt Envoy makes, so a pick of
    an engine that died since its last scrape moves on to a live one (issue 27 item 9).
    An explicitly configured picker keeps GIE's default of one."""
    import dataclasses

    from infergate.epp.scheduling.plugins.pickers import DEFAULT_FALLBACK_ENDPOINTS

    from infergate.envoy.bootstrap import EnvoyConfig

    (field,) = [f for f in dataclasses.fields(EnvoyConfig) if f.name == "fallback_retries"]
    retries = field.default
    assert isinstance(retries, int)
    assert retries + 1 == DEFAULT_FALLBACK_ENDPOINTS
    for name in ("infergate-default", "precise-prefix", "flow-control"):
        (profile,) = build(BUILTIN_CONFIGS[name]).profiles
        assert profile.picker is not None
        assert (
            profile.picker.params.model_dump()["maxNumOfEndpoints"] == DEFAULT_FALLBACK_ENDPOINTS
        ), name
    implicit = build("kind: EndpointPickerConfig\nplugins:\n- type: queue-scorer\n")
    (profile,) = implicit.profiles
    assert profile.picker is not None
    assert profile.picker.params.model_dump()["maxNumOfEndpoints"] == DEFAULT_FALLBACK_ENDPOINTS
    explicit = build("kind: EndpointPickerConfig\nplugins:\n- type: max-score-picker\n")
    (profile,) = explicit.profiles
    assert (
        profile.picker is not None and profile.picker.params.model_dump()["maxNumOfEndpoints"] == 1
    )
