"""Flow control: queue ordering (bands, fairness, FCFS), bounds, TTL, cancellation, config."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
from infergate.epp.config import ConfigError, load_config, parse_config
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.flowcontrol.config import FlowControlConfig, flow_control_config
from infergate.epp.flowcontrol.controller import (
    FAIRNESS_HEADER,
    FlowController,
    FlowRejected,
    Ticket,
    cost_estimate,
    fairness_id,
)
from infergate.epp.flowcontrol.metrics import FlowControlMetrics
from infergate.epp.flowcontrol.queues import HISTORY_LIMIT, BandQueues, QueueItem
from infergate.epp.flowcontrol.saturation import SaturationDetector
from infergate.epp.types import Endpoint
from prometheus_client import CollectorRegistry, generate_latest

# -- queues ------------------------------------------------------------------------------


def item(flow: str = "default", priority: int = 0, size: int = 10, cost: float = 1.0) -> QueueItem:
    return QueueItem(flow=flow, priority=priority, size=size, enqueued=0.0, cost_estimate=cost)


def drain(queues: BandQueues) -> list[QueueItem]:
    out = []
    while (next_item := queues.pop()) is not None:
        out.append(next_item)
    return out


def test_higher_band_first_then_fcfs_within_a_flow() -> None:
    queues = BandQueues()
    low = [item(priority=-1) for _ in range(3)]
    high = [item(priority=10) for _ in range(2)]
    mid = item(priority=0)
    for it in (low[0], mid, low[1], high[0], low[2], high[1]):
        queues.add(it)
    assert drain(queues) == [high[0], high[1], mid, *low]
    assert queues.bands == {} and len(queues) == 0 and queues.bytes == 0


def test_round_robin_gives_backlogged_flows_equal_turns_whatever_their_rates() -> None:
    queues = BandQueues("round-robin")
    for _ in range(100):
        queues.add(item("heavy"))
    for _ in range(10):
        queues.add(item("light"))
    first = Counter(it.flow for it in drain(queues)[:20])
    assert first == {"heavy": 10, "light": 10}


def test_token_fair_share_equalises_tokens_not_requests() -> None:
    queues = BandQueues("token-fair-share")
    for _ in range(50):
        queues.add(item("big", cost=100.0))
    for _ in range(50):
        queues.add(item("small", cost=10.0))
    served = Counter[str]()
    for it in drain(queues)[:33]:
        served[it.flow] += int(it.cost_estimate)
    # 3 big (300 tokens) ~ 30 small (300 tokens): within one big request of each other.
    assert abs(served["big"] - served["small"]) <= 100
    assert served["big"] == 300 and served["small"] == 300


def test_usage_correction_moves_a_flow_back_in_line() -> None:
    queues = BandQueues("token-fair-share")
    for name in ("a", "b"):
        for _ in range(3):
            queues.add(item(name, cost=10.0))
    first = queues.pop()
    assert first is not None
    # Its real usage was 1000 tokens, not 10: the other flow goes next, twice.
    queues.charge(0, first.flow, 990.0)
    other = "b" if first.flow == "a" else "a"
    nxt = [queues.pop(), queues.pop()]
    assert [it.flow for it in nxt if it is not None] == [other, other]


def test_returning_flow_gets_no_banked_credit() -> None:
    queues = BandQueues("token-fair-share")
    for _ in range(20):
        queues.add(item("busy", cost=10.0))
    for _ in range(10):
        queues.pop()  # busy has served 100 tokens alone
    for _ in range(5):
        queues.add(item("newcomer", cost=10.0))
    order = [it.flow for it in drain(queues)[:6]]
    # It starts level with "busy", so they alternate instead of newcomer taking 5 in a row.
    assert order.count("newcomer") <= 4 and order.count("busy") >= 2


def test_remove_anywhere_leaves_no_state() -> None:
    queues = BandQueues("token-fair-share")
    items = [item(f"t{i % 7}", priority=i % 3, size=i) for i in range(200)]
    for it in items:
        queues.add(it)
    for it in items[::2]:
        assert queues.remove(it)
        assert not queues.remove(it)  # already gone: a second removal is a no-op
    rest = drain(queues)
    assert sorted(it.id for it in rest) == sorted(it.id for it in items[1::2])
    assert queues.bands == {} and queues.bytes == 0 and len(queues) == 0


def test_fairness_history_is_bounded() -> None:
    queues = BandQueues("token-fair-share")
    for i in range(HISTORY_LIMIT + 50):
        queues.add(item(f"tenant-{i}"))
        queues.pop()
    assert len(queues.history) == HISTORY_LIMIT
    rr = BandQueues("round-robin")
    for i in range(100):
        rr.add(item(f"tenant-{i}"))
        rr.pop()
    assert len(rr.history) == 0


def test_fairness_id_header_and_cost() -> None:
    assert fairness_id({}) == "default"
    assert fairness_id({FAIRNESS_HEADER: "  "}) == "default"
    assert fairness_id({FAIRNESS_HEADER: "team-a"}) == "team-a"
    assert len(fairness_id({FAIRNESS_HEADER: "x" * 10_000})) == 128
    assert cost_estimate(400, 50) == 150.0
    assert cost_estimate(0, None) == 1.0


# -- config ------------------------------------------------------------------------------


def test_flow_control_is_off_unless_configured() -> None:
    assert load_config(None).flowControl is None
    assert flow_control_config(None) is None
    assert flow_control_config({"enabled": False, "maxRequestsPerEndpoint": 2}) is None
    on = load_config("builtin:flow-control").flowControl
    assert on is not None and on.maxRequestsPerEndpoint == 4 and on.defaultRequestTTL == 20.0


def test_durations_and_bands_parse() -> None:
    config = parse_config(
        "flowControl:\n"
        "  defaultRequestTTL: 1500ms\n"
        "  dispatchInterval: 0.01\n"
        "  maxRequestsPerEndpoint: 2\n"
        "  priorityBands: [{priority: -1, maxRequests: 5, maxBytes: 100, requestTTL: 2m}]\n"
    ).flowControl
    assert config is not None
    assert config.defaultRequestTTL == 1.5 and config.dispatchInterval == 0.01
    assert config.band(-1) == (5, 100) and config.band(0) == (None, None)
    assert config.ttl(-1) == 120.0 and config.ttl(0) == 1.5


@pytest.mark.parametrize(
    ("yaml_text", "named"),
    [
        ("flowControl: {maxQueue: 5}", "flowControl.maxQueue: Extra inputs are not permitted"),
        ("flowControl: {defaultRequestTTL: soon}", "flowControl.defaultRequestTTL"),
        ("flowControl: {defaultRequestTTL: 0}", "flowControl.defaultRequestTTL"),
        ("flowControl: {maxRequests: 0}", "flowControl.maxRequests"),
        ("flowControl: {fairnessPolicy: lottery}", "flowControl.fairnessPolicy"),
        (
            "flowControl: {priorityBands: [{priority: 1}, {priority: 1}]}",
            "priorityBands[1].priority 1 is repeated",
        ),
        (
            "flowControl: {priorityBands: [{priority: 1, maxReqs: 3}]}",
            "flowControl.priorityBands[0].maxReqs",
        ),
        ("flowControl: {useSaturationDetector: false}", "needs a capacity signal"),
        ("flowControl: [1, 2]", "flowControl"),
        (
            "flowControl: {priorityBands: [{priority: 1, requestTTL: -1s}]}",
            "flowControl.priorityBands[0].requestTTL",
        ),
    ],
)
def test_bad_flow_control_config_is_named(yaml_text: str, named: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(yaml_text)
    assert named in str(error.value)


# -- controller --------------------------------------------------------------------------


def make_controller(
    endpoints: int = 1, registry: CollectorRegistry | None = None, **overrides: object
) -> FlowController:
    datastore = Datastore()
    datastore.set_endpoints([Endpoint("127.0.0.1", 8000 + i) for i in range(endpoints)])
    settings: dict[str, object] = {
        "maxRequestsPerEndpoint": 1,
        "useSaturationDetector": False,
        "defaultRequestTTL": 5.0,
        "dispatchInterval": 0.005,
    }
    settings.update(overrides)
    config = FlowControlConfig.model_validate(settings)
    metrics = FlowControlMetrics(registry or CollectorRegistry())
    return FlowController(config, datastore, SaturationDetector(5, 0.8, 2.0), metrics)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_dispatch_waits_for_capacity_and_higher_priority_goes_first() -> None:
    flow = make_controller()
    first = await flow.admit(0, "default", 10)  # capacity: goes at once
    order: list[str] = []

    async def wait(name: str, priority: int) -> Ticket:
        ticket = await flow.admit(priority, "default", 10)
        order.append(name)
        return ticket

    low = asyncio.create_task(wait("low", -1))
    await settle()
    high = asyncio.create_task(wait("high", 10))
    await settle()
    assert order == [] and len(flow.queues) == 2 and flow.in_flight == 1
    flow.release(first)
    high_ticket = await high
    await settle()
    assert order == ["high"] and not low.done()
    flow.release(high_ticket)
    flow.release(high_ticket)  # twice is once
    flow.release(await low)
    assert order == ["high", "low"] and flow.in_flight == 0 and len(flow.queues) == 0


async def test_ttl_expiry_is_a_rejection_that_leaves_nothing_queued() -> None:
    registry = CollectorRegistry()
    flow = make_controller(registry=registry, defaultRequestTTL=0.05)
    held = await flow.admit(0, "default", 10)
    with pytest.raises(FlowRejected) as error:
        await flow.admit(-1, "batch", 10)
    assert error.value.reason == "ttl_expired" and "TTL" in error.value.message
    assert len(flow.queues) == 0 and flow.queues.bands == {}
    text = generate_latest(registry).decode()
    assert (
        'infergate_epp_flow_control_rejections_total{priority="-1",reason="ttl_expired"} 1.0'
        in text
    )
    flow.release(held)
    assert flow.in_flight == 0


async def test_cancelled_waiter_leaves_the_queue_at_once() -> None:
    flow = make_controller()
    held = await flow.admit(0, "default", 10)
    waiters = [asyncio.create_task(flow.admit(0, f"t{i}", 100)) for i in range(5)]
    await settle()
    assert len(flow.queues) == 5 and flow.queues.bytes == 500
    for task in waiters:
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert len(flow.queues) == 0 and flow.queues.bytes == 0 and flow.queues.bands == {}
    flow.release(held)
    assert flow.in_flight == 0


async def test_dispatched_then_cancelled_gives_its_capacity_back() -> None:
    flow = make_controller()
    held = await flow.admit(0, "default", 10)
    waiter = asyncio.create_task(flow.admit(0, "default", 10))
    await settle()
    flow.release(held)  # dispatches the waiter (its future resolved)...
    waiter.cancel()  # ...but its client left before it ran
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert flow.in_flight == 0 and len(flow.queues) == 0


@pytest.mark.parametrize(
    ("overrides", "size", "says"),
    [
        ({"maxRequests": 3}, 1, "maximum of 3 requests"),
        ({"maxBytes": 250}, 100, "maximum of 250 bytes"),
        (
            {"priorityBands": [{"priority": 0, "maxRequests": 2}]},
            1,
            "band 0 holds its maximum of 2",
        ),
        ({"priorityBands": [{"priority": 0, "maxBytes": 150}]}, 100, "maximum of 150 bytes"),
    ],
)
async def test_bounds_reject_with_a_reason(overrides: dict[str, Any], size: int, says: str) -> None:
    flow = make_controller(**overrides)
    held = await flow.admit(0, "default", 1)
    waiters = []
    with pytest.raises(FlowRejected) as error:
        for _ in range(4):
            waiters.append(asyncio.create_task(flow.admit(0, "default", size)))
            await settle()
            for task in waiters:
                if task.done():
                    task.result()
    assert error.value.reason == "queue_full" and says in error.value.message
    # Another band (or the dispatched request) is unaffected; then everyone leaves.
    for task in waiters:
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    flow.release(held)
    assert len(flow.queues) == 0 and flow.in_flight == 0


async def test_saturation_detector_holds_until_an_endpoint_has_room() -> None:
    flow = make_controller(maxRequestsPerEndpoint=None, useSaturationDetector=True)
    state = flow.datastore.all()[0]
    state.metrics.updated_at = 0.0  # never scraped: saturated (stale)
    waiter = asyncio.create_task(flow.admit(0, "default", 1))
    await asyncio.sleep(0.03)
    assert not waiter.done() and len(flow.queues) == 1
    state.metrics.updated_at = flow.clock()  # a fresh, idle scrape: the ticker dispatches
    ticket = await asyncio.wait_for(waiter, 2.0)
    flow.release(ticket)
    assert flow.in_flight == 0


async def test_burst_of_10000_respects_the_bound_and_empties_completely() -> None:
    registry = CollectorRegistry()
    flow = make_controller(registry=registry, maxRequests=10_000)
    held = await flow.admit(0, "default", 1)
    waiters = [
        asyncio.create_task(flow.admit(i % 3 - 1, f"tenant-{i % 50}", 512)) for i in range(10_000)
    ]
    await settle()
    assert len(flow.queues) == 10_000 and flow.queues.bytes == 10_000 * 512
    with pytest.raises(FlowRejected):
        await flow.admit(0, "one-too-many", 1)
    text = generate_latest(registry).decode()
    assert "inference_extension_flow_control_queue_size{" in text
    assert "inference_extension_flow_control_queue_bytes{" in text
    for task in waiters:
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    flow.release(held)
    assert len(flow.queues) == 0 and flow.queues.bands == {} and flow.in_flight == 0
    assert not flow.queues._index
    await flow.close()


async def test_queue_gauges_follow_the_live_queues() -> None:
    registry = CollectorRegistry()
    flow = make_controller(registry=registry)
    held = await flow.admit(0, "default", 1)
    waiters = [asyncio.create_task(flow.admit(-1, "team-a", 100)) for _ in range(3)]
    await settle()
    text = generate_latest(registry).decode()
    labels = 'fairness_id="team-a",inference_pool="local",priority="-1"'
    assert f"inference_extension_flow_control_queue_size{{{labels}}} 3.0" in text
    assert f"inference_extension_flow_control_queue_bytes{{{labels}}} 300.0" in text
    assert "infergate_epp_flow_control_in_flight_requests 1.0" in text
    for task in waiters:
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    text = generate_latest(registry).decode()
    assert not [line for line in text.splitlines() if "team-a" in line]  # no series left
    flow.release(held)
