"""Load reports applied to the datastore (:class:`LoadReports`): an idle engine's
heartbeat, equal to its previous report but for the send time, leaves the snapshot as it
is and only makes it newer; any other report, or one after a scrape replaced the
snapshot, is applied whole."""

from __future__ import annotations

import time

import pytest
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.datalayer.load_reports import (
    PUSH_GRACE_HEARTBEATS,
    LoadReports,
    push_alive,
    push_deadline,
    snapshot,
)
from infergate.epp.types import Endpoint, Metrics

from infergate.wire import load


def _payload(waiting: int, sent_at: float) -> bytes:
    return load.encode(
        load.LoadReport(
            sent_at=sent_at,
            tick=0.01,
            heartbeat=0.5,
            waiting=waiting,
            running=1,
            kv_usage=0.25,
            block_size=16,
            num_gpu_blocks=1000,
            max_lora=0,
            running_adapters=[],
            waiting_adapters=[],
            prefill_seconds_sum=1.0,
            prefill_count=2.0,
            prompt_tokens_total=300.0,
            prefix_hits_total=100.0,
            prefix_queries_total=300.0,
        )
    )


def _fleet() -> tuple[Datastore, str, list[float]]:
    datastore = Datastore()
    endpoint = Endpoint("127.0.0.1", 8000)
    datastore.set_endpoints([endpoint])
    return datastore, endpoint.key, [100.0]


def test_a_heartbeat_equal_to_the_last_report_only_refreshes_the_snapshot() -> None:
    datastore, key, now = _fleet()
    reports = LoadReports(datastore, clock=lambda: now[0])
    reports.on_payload(key, _payload(3, time.time()))
    first = datastore.get(key).metrics  # type: ignore[union-attr]
    assert (first.waiting, first.updated_at) == (3, pytest.approx(100.0, abs=0.01))

    now[0] = 100.5
    reports.on_payload(key, _payload(3, time.time()))
    state = datastore.get(key)
    assert state is not None
    assert state.metrics is first  # not rebuilt: the same view...
    assert state.metrics.updated_at == pytest.approx(100.5, abs=0.01)  # ...only newer
    assert reports.received == 2

    now[0] = 101.0
    reports.on_payload(key, _payload(4, time.time()))  # a change is applied whole
    assert state.metrics is not first
    assert (state.metrics.waiting, state.metrics.updated_at) == (4, pytest.approx(101.0, abs=0.01))


def test_a_report_after_a_scrape_replaced_the_snapshot_is_applied_whole() -> None:
    datastore, key, now = _fleet()
    reports = LoadReports(datastore, clock=lambda: now[0])
    reports.on_payload(key, _payload(3, time.time()))
    state = datastore.get(key)
    assert state is not None
    state.metrics = Metrics(waiting=9, updated_at=100.2)  # a scrape came in between
    now[0] = 100.5
    reports.on_payload(key, _payload(3, time.time()))
    metrics = state.metrics
    assert (metrics.waiting, metrics.pushed) == (3, True)
    assert metrics.updated_at == pytest.approx(100.5, abs=0.01)


def test_a_report_read_late_is_dated_when_it_was_sent() -> None:
    """Reports are read when a decision needs them, so one may be read a while after the
    engine sent it (and the engine may have died since): its age and the push stream's
    liveness run from the send time, not from the read."""
    report = load.decode(_payload(3, 1000.0))
    metrics = snapshot(report, now=100.0, wall=1000.4)  # read 0.4 s after it was sent
    assert metrics.updated_at == pytest.approx(99.6) and metrics.lag == 0.0
    assert metrics.age(100.0) == pytest.approx(0.4)
    deadline = 100.0 - 0.4 + PUSH_GRACE_HEARTBEATS * report.heartbeat
    assert push_deadline(metrics) == pytest.approx(deadline)
    assert push_alive(metrics, deadline - 0.01) and not push_alive(metrics, deadline + 0.01)
