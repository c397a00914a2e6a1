"""Collectors against real HTTP metrics servers (prometheus_client) and a real engine."""

from __future__ import annotations

import time

from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.datalayer.dialects import (
    ENGINE_TYPE_LABEL,
    SGLANG,
    VLLM,
    dialect_for,
    parse_metrics,
)
from infergate.epp.flowcontrol.saturation import SaturationDetector
from infergate.epp.types import Endpoint
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from .conftest import eventually


async def test_collector_follows_live_metrics_and_goes_stale(engine_metrics, epp_factory) -> None:
    server = engine_metrics()
    endpoint = Endpoint("127.0.0.1", server.port)
    epp = await epp_factory(static_endpoints=[endpoint], metrics_staleness_threshold=0.5)
    state = epp.datastore.get(endpoint.key)
    assert state is not None
    server.set(waiting=3, running=2, kv=0.5)
    await eventually(lambda: state.metrics.waiting == 3)
    assert state.metrics.running == 2
    assert state.metrics.kv_usage == 0.5
    assert (state.metrics.block_size, state.metrics.num_gpu_blocks) == (16, 1024)
    assert not epp.saturation.is_saturated(state)
    server.set(waiting=7, running=2, kv=0.5)
    await eventually(lambda: state.metrics.waiting == 7)
    assert epp.saturation.is_saturated(state)  # queue threshold 5
    server.set(waiting=0, running=0, kv=0.1)
    await eventually(lambda: state.metrics.waiting == 0)
    server.close()  # the engine dies: the snapshot ages into staleness
    await eventually(lambda: epp.saturation.is_stale(state), timeout=10)
    assert epp.saturation.is_saturated(state)
    await eventually(lambda: epp.collectors.failures > 0, timeout=10)  # 1 s scrape timeout


async def test_collectors_follow_the_endpoint_set(engine_metrics, epp_factory) -> None:
    one, two = engine_metrics(), engine_metrics()
    a, b = Endpoint("127.0.0.1", one.port), Endpoint("127.0.0.1", two.port)
    epp = await epp_factory(static_endpoints=[a])
    epp.datastore.set_endpoints([a, b])
    two.set(4, 0, 0.0)
    await eventually(lambda: (s := epp.datastore.get(b.key)) is not None and s.metrics.waiting == 4)
    epp.datastore.set_endpoints([b])
    await eventually(lambda: a.key not in epp.collectors._tasks.tasks)
    assert set(epp.collectors._tasks.tasks) == {b.key}


def test_sglang_dialect_by_label() -> None:
    registry = CollectorRegistry()
    Gauge("sglang:num_queue_reqs", "q", registry=registry).set(4)
    Gauge("sglang:num_running_reqs", "r", registry=registry).set(9)
    Gauge("sglang:token_usage", "u", registry=registry).set(0.25)
    Gauge("vllm:num_requests_waiting", "decoy", registry=registry).set(99)
    endpoint = Endpoint("10.0.0.1", 30000, ((ENGINE_TYPE_LABEL, "sglang"),))
    assert dialect_for(endpoint) is SGLANG
    assert dialect_for(Endpoint("10.0.0.1", 8000)) is VLLM
    metrics = parse_metrics(generate_latest(registry), SGLANG)
    assert (metrics.waiting, metrics.running, metrics.kv_usage) == (4, 9, 0.25)


def test_lora_info_takes_the_newest_series() -> None:
    registry = CollectorRegistry()
    info = Gauge(
        "vllm:lora_requests_info",
        "lora",
        ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        registry=registry,
    )
    info.labels("old", "", "2").set(100.0)
    info.labels("sql,chat", "math", "4").set(200.0)
    metrics = parse_metrics(generate_latest(registry), VLLM)
    assert metrics.active_models == {"sql", "chat"}
    assert metrics.waiting_models == {"math"}
    assert metrics.max_active_models == 4


def test_garbage_metrics_raise_cleanly() -> None:
    import pytest

    with pytest.raises(ValueError):
        parse_metrics(b"vllm:num_requests_waiting{oops 1\n", VLLM)
    assert parse_metrics(b"", VLLM).waiting == 0


def test_stale_snapshot_is_saturated() -> None:
    from infergate.epp.types import EndpointState, Metrics

    detector = SaturationDetector(5, 0.8, 2.0)
    state = EndpointState(Endpoint("a", 1), Metrics(updated_at=time.monotonic() - 3))
    assert detector.is_stale(state) and detector.is_saturated(state)
    state.metrics.updated_at = time.monotonic()
    assert not detector.is_saturated(state)
    assert Datastore().all() == []


def test_counts_reported_needs_both_gauges() -> None:
    """The lost-record bound trusts running + waiting only when the scrape had both."""
    both = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
    assert parse_metrics(both, VLLM).counts_reported
    assert not parse_metrics(b"vllm:num_requests_running 2\n", VLLM).counts_reported
    assert not parse_metrics(b"", VLLM).counts_reported
