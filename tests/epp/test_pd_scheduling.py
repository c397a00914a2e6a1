"""Prefill/decode disaggregation in the EPP: roles, role filters, the P/D profile handler."""

from __future__ import annotations

import time

import pytest
from infergate.epp.config import BUILTIN_CONFIGS, ConfigError, parse_config
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.datalayer.objectives import ObjectiveStore
from infergate.epp.flowcontrol.saturation import SaturationDetector
from infergate.epp.observability import EppMetrics
from infergate.epp.requestcontrol.director import Director
from infergate.epp.scheduling.plugins import PluginContext
from infergate.epp.scheduling.plugins.roles import role_of
from infergate.epp.scheduling.scheduler import Scheduler
from infergate.epp.types import Endpoint, EndpointState, InferenceRequest, Metrics

from infergate.wire.names import PREFILL_HEADER

PD_YAML = """\
plugins:
- type: pd-profile-handler
  parameters: {threshold: %d}
- type: decode-filter
- type: prefill-filter
- type: prefix-cache-scorer
- type: queue-scorer
schedulingProfiles:
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: prefix-cache-scorer, weight: 3},
            {pluginRef: queue-scorer, weight: 1}]
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: queue-scorer, weight: 1}]
"""


def ep(i: int, role: str | None, waiting: int = 0, key: str = "llm-d.ai/role") -> EndpointState:
    labels = ((key, role),) if role is not None else ()
    metrics = Metrics(waiting=waiting, updated_at=time.monotonic())
    return EndpointState(Endpoint(f"10.0.0.{i}", 8000, labels), metrics)


def scheduler(yaml_text: str) -> Scheduler:
    context = PluginContext(Datastore(), SaturationDetector(5, 0.8, 2.0))
    return Scheduler.from_config(parse_config(yaml_text), context)


def director(yaml_text: str) -> Director:
    """A Director over the config's scheduler: ``schedule`` runs one cycle as a request
    would (data preparers, profiles, pre-request hooks)."""
    datastore, saturation = Datastore(), SaturationDetector(5, 0.8, 2.0)
    s = Scheduler.from_config(parse_config(yaml_text), PluginContext(datastore, saturation))
    return Director(datastore, s, saturation, ObjectiveStore(), EppMetrics(datastore, saturation))


def request(prompt: str) -> InferenceRequest:
    r = InferenceRequest("r", {}, body={"model": "m", "prompt": prompt}, model="m")
    r.prompt_text = prompt
    return r


def test_roles_from_labels() -> None:
    assert role_of(ep(1, "prefill").endpoint) == "prefill"
    assert role_of(ep(1, "Decode").endpoint) == "decode"
    assert role_of(ep(1, "prefill", key="infergate.dev/role").endpoint) == "prefill"
    assert role_of(ep(1, None).endpoint) == "both"
    assert role_of(ep(1, "gpu-poor").endpoint) == "both"


async def test_long_uncached_prompt_is_disaggregated_short_is_not() -> None:
    s = director(PD_YAML % 100)
    pool = [ep(1, "prefill"), ep(2, "prefill", waiting=3), ep(3, "decode"), ep(4, "both")]
    long = await s.schedule(request("word " * 400), pool)  # ~500 tokens at 4 chars/token
    assert long.profile == "decode"
    assert long.primary is not None and long.primary.key in ("10.0.0.3:8000", "10.0.0.4:8000")
    assert long.request_headers.get(PREFILL_HEADER) == "10.0.0.1:8000"  # the idle prefill pod
    assert long.remote_prefill
    assert set(long.profile_results) == {"decode", "prefill"}

    short = await s.schedule(request("hello there"), pool)
    assert short.primary is not None and short.primary.key in ("10.0.0.3:8000", "10.0.0.4:8000")
    assert PREFILL_HEADER not in short.request_headers
    assert set(short.profile_results) == {"decode"}  # the prefill profile never ran


async def test_cached_prompt_on_decode_pick_is_not_disaggregated() -> None:
    """The second time, the prefix index says the decode pick holds the prompt."""
    s = director(PD_YAML % 100)
    pool = [ep(1, "prefill"), ep(3, "decode")]
    prompt = "the same long system prompt " * 80
    first = await s.schedule(request(prompt), pool)
    assert PREFILL_HEADER in first.request_headers
    again = await s.schedule(request(prompt + " and a short question"), pool)
    assert again.primary is not None and again.primary.key == "10.0.0.3:8000"
    assert PREFILL_HEADER not in again.request_headers


async def test_no_prefill_endpoint_means_local_prefill() -> None:
    s = director(PD_YAML % 0)
    result = await s.schedule(request("x " * 1000), [ep(3, "decode"), ep(4, None)])
    assert result.primary is not None
    assert PREFILL_HEADER not in result.request_headers
    assert not result.remote_prefill


async def test_a_stale_prefill_endpoint_leaves_the_prefill_profile() -> None:
    s = director(PD_YAML % 0)
    hung = ep(1, "prefill")  # accepts connections, answers nothing: its scrapes time out
    hung.metrics.updated_at = time.monotonic() - 3.0  # older than the 2 s threshold
    fresh = ep(2, "prefill", waiting=3)
    pool = [hung, fresh, ep(3, "decode")]
    result = await s.schedule(request("x " * 1000), pool)
    assert result.request_headers.get(PREFILL_HEADER) == "10.0.0.2:8000"  # busier, but alive
    fresh.metrics.updated_at = hung.metrics.updated_at  # now both are stale
    alone = await s.schedule(request("y " * 1000), pool)
    assert alone.primary is not None and alone.primary.key == "10.0.0.3:8000"
    assert PREFILL_HEADER not in alone.request_headers and not alone.remote_prefill  # prefills locally


async def test_only_prefill_endpoints_leaves_no_decode_target() -> None:
    s = director(PD_YAML % 0)
    result = await s.schedule(request("x " * 1000), [ep(1, "prefill")])
    assert result.targets == []  # the director answers 503


def test_builtin_pd_config_builds() -> None:
    s = scheduler(BUILTIN_CONFIGS["pd"])
    assert s.profile_names == ["decode", "prefill"]
    assert type(s.handler).__name__ == "PdProfileHandler"


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        (
            "plugins: [{type: queue-scorer}]\nschedulingProfiles:\n"
            "- {name: a, plugins: [{pluginRef: queue-scorer}]}\n"
            "- {name: b, plugins: [{pluginRef: queue-scorer}]}\n",
            "need a profile handler",
        ),
        (
            (PD_YAML % 0).replace("name: prefill", "name: prefil"),
            "no scheduling profile named 'prefill'",
        ),
        (
            (PD_YAML % 0).replace("threshold: 0", "threshold: -1"),
            "plugins[0].parameters.threshold",
        ),
        (
            (PD_YAML % 0) + "- {name: extra, plugins: []}\n",
            "would never run",
        ),
        (
            (PD_YAML % 0).replace("plugins:\n", "plugins:\n- type: single-profile-handler\n", 1),
            "one profile handler at most",
        ),
    ],
)
def test_bad_pd_configs_name_the_problem(yaml_text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        scheduler(yaml_text)
