"""Flow control on predicted prefill: the queue gate (``maxPrefillQueueSeconds``) and the
order inside a flow (``prefillOrderWeight``), from the queues up through the director."""

from __future__ import annotations

import asyncio
import json

import pytest
from infergate.epp.config import ConfigError, parse_config
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.flowcontrol.config import FlowControlConfig
from infergate.epp.flowcontrol.controller import FlowController, prefill_queue_seconds
from infergate.epp.flowcontrol.metrics import FlowControlMetrics
from infergate.epp.flowcontrol.queues import BandQueues, QueueItem
from infergate.epp.flowcontrol.saturation import SaturationDetector
from infergate.epp.types import Endpoint, InferenceRequest, Metrics
from prometheus_client import CollectorRegistry

from tests.epp.test_flowcontrol import drain
from tests.epp.test_flowcontrol_director import make_director


def item(order: float, flow: str = "default", priority: int = 0) -> QueueItem:
    return QueueItem(flow=flow, priority=priority, size=1, enqueued=0.0, order=order)


def test_an_ordered_flow_gives_the_least_order_first_and_bands_stay_strict() -> None:
    queues = BandQueues(ordered=True)
    late_short, early_long, middle = item(1.0), item(5.0), item(3.0)
    urgent = item(9.0, priority=10)
    for it in (early_long, late_short, urgent, middle):
        queues.add(it)
    assert drain(queues) == [urgent, late_short, middle, early_long]
    fcfs = BandQueues()
    for it in (early_long, late_short, middle):
        fcfs.add(it)
    assert drain(fcfs) == [early_long, late_short, middle]  # unordered: arrival order


def test_removed_items_are_skipped_and_their_heap_entries_do_not_pile_up() -> None:
    queues = BandQueues(ordered=True)
    keep = item(50.0)
    gone = [item(float(i)) for i in range(40)]
    for it in (*gone, keep):
        queues.add(it)
    for it in gone:
        assert queues.remove(it)
    flow = queues.bands[0].flows["default"]
    assert len(flow.heap) <= 2 * len(flow.items) + 16  # rebuilt, not 41 entries
    assert drain(queues) == [keep] and len(queues) == 0 and queues.bands == {}


def test_prefill_fields_parse_and_bad_values_are_named() -> None:
    config = parse_config(
        "flowControl: {useSaturationDetector: false, maxPrefillQueueSeconds: 0.5, "
        "prefillOrderWeight: 1}"
    ).flowControl
    assert config is not None
    parsed = FlowControlConfig.model_validate(config)
    assert parsed.maxPrefillQueueSeconds == 0.5 and parsed.prefillOrderWeight == 1.0
    for field, value in (("maxPrefillQueueSeconds", -1), ("prefillOrderWeight", -0.5)):
        with pytest.raises(ConfigError) as error:
            parse_config(f"flowControl: {{{field}: {value}}}")
        assert f"flowControl.{field}" in str(error.value)


def make_controller(**overrides: object) -> FlowController:
    datastore = Datastore()
    datastore.set_endpoints([Endpoint("127.0.0.1", 8000), Endpoint("127.0.0.1", 8001)])
    settings: dict[str, object] = {
        "useSaturationDetector": False,
        "maxPrefillQueueSeconds": 0.5,
        "defaultRequestTTL": 5.0,
        "dispatchInterval": 0.005,
    }
    settings.update(overrides)
    config = FlowControlConfig.model_validate(settings)
    metrics = FlowControlMetrics(CollectorRegistry())
    return FlowController(config, datastore, SaturationDetector(5, 0.8, 2.0), metrics)


async def test_the_gate_holds_while_every_endpoint_has_more_prefill_queued() -> None:
    flow = make_controller()
    first, second = flow.datastore.all()
    now = flow.clock()
    first.prefill_busy_until, second.prefill_busy_until = now + 3.0, now + 2.0
    assert prefill_queue_seconds(second, now) == pytest.approx(2.0)
    waiter = asyncio.create_task(flow.admit(0, "default", 1))
    await asyncio.sleep(0.03)
    assert not waiter.done() and len(flow.queues) == 1
    second.prefill_busy_until = flow.clock() + 0.2  # one engine is nearly through its queue
    ticket = await asyncio.wait_for(waiter, 2.0)
    flow.release(ticket)
    assert flow.in_flight == 0 and len(flow.queues) == 0


async def test_a_short_prefill_overtakes_a_long_one_only_with_the_order() -> None:
    for weight, first_out in ((1.0, "short"), (None, "long")):
        flow = make_controller(prefillOrderWeight=weight)
        states = flow.datastore.all()
        for state in states:
            state.prefill_busy_until = flow.clock() + 10.0
        order: list[str] = []

        async def wait(
            name: str, seconds: float, flow: FlowController = flow, order: list[str] = order
        ) -> None:
            flow.release(await flow.admit(0, "default", 1, prefill_seconds=seconds))
            order.append(name)

        long = asyncio.create_task(wait("long", 4.0))
        await asyncio.sleep(0.01)
        short = asyncio.create_task(wait("short", 0.1))
        await asyncio.sleep(0.01)
        assert order == [] and len(flow.queues) == 2
        for state in states:
            state.prefill_busy_until = 0.0
        await asyncio.wait_for(asyncio.gather(long, short), 2.0)
        assert order[0] == first_out, weight


def test_a_reporting_engines_queue_is_its_running_and_waiting_prefill() -> None:
    """From a pushed load report the queue is the engine's own (its running requests'
    pending prefill, drained since the report, and its waiting requests' uncached
    tokens), not the latency model's clock; without reports, the clock."""
    flow = make_controller()
    state = flow.datastore.all()[0]
    now = flow.clock()
    state.prefill_busy_until = now + 30.0  # the clock's prediction
    assert prefill_queue_seconds(state, now) == pytest.approx(30.0)
    per_token = state.cost.per_token
    state.metrics = Metrics(
        prefill_pending_tokens=1.0 / per_token,  # 1 s running
        prefill_waiting_tokens=2.0 / per_token,  # 2 s waiting
        updated_at=now,
        heartbeat=0.5,
    )
    assert prefill_queue_seconds(state, now) == pytest.approx(3.0)
    assert prefill_queue_seconds(state, now + 0.5) == pytest.approx(2.5)


async def test_the_gate_lets_one_request_go_until_it_is_placed() -> None:
    flow = make_controller()
    states = flow.datastore.all()
    for state in states:
        state.prefill_busy_until = flow.clock() + 10.0
    waiters = [asyncio.create_task(flow.admit(0, "default", 1)) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert len(flow.queues) == 3
    for state in states:
        state.prefill_busy_until = 0.0  # the gate opens: one leaves, the rest wait for it
    await asyncio.sleep(0.03)
    done = [w for w in waiters if w.done()]
    assert len(done) == 1 and flow.placing == 1 and len(flow.queues) == 2
    flow.placed(done[0].result())  # scheduled: its prefill is on a clock; the next goes
    await asyncio.sleep(0)
    assert sum(w.done() for w in waiters) == 2 and flow.placing == 1
    for waiter in waiters:
        ticket = await asyncio.wait_for(waiter, 2.0)
        flow.placed(ticket)
        flow.release(ticket)
    assert flow.placing == 0 and flow.in_flight == 0 and len(flow.queues) == 0


def body(prompt: str) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4}).encode()


async def test_the_director_orders_held_requests_by_the_latency_models_prefill() -> None:
    director = make_director(
        "flowControl: {useSaturationDetector: false, maxPrefillQueueSeconds: 0.5, "
        "prefillOrderWeight: 1, defaultRequestTTL: 5s}"
    )
    flow = director.flow
    assert flow is not None
    state = director.datastore.all()[0]
    state.prefill_busy_until = flow.clock() + 60.0  # the gate is shut
    long = asyncio.create_task(
        director.route(InferenceRequest(request_id="a", headers={}), body("word " * 40_000), None)
    )
    await asyncio.sleep(0.01)
    short = asyncio.create_task(
        director.route(InferenceRequest(request_id="b", headers={}), body("hi"), None)
    )
    await asyncio.sleep(0.01)
    held = sorted(flow.queues._index.values(), key=lambda it: it.enqueued)
    assert len(held) == 2
    # The long prompt came first, but its predicted prefill puts it behind the short one.
    assert held[0].order > held[1].order > held[1].enqueued
    long.cancel()
    short.cancel()
    await asyncio.gather(long, short, return_exceptions=True)
    assert len(flow.queues) == 0
