"""Flow control inside the director: enqueue → dispatch → schedule → finish releases."""

from __future__ import annotations

import asyncio
import json

import pytest
from infergate.epp.config import load_config, parse_config
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.datalayer.objectives import ObjectiveStore
from infergate.epp.flowcontrol import build_flow_controller
from infergate.epp.flowcontrol.controller import FAIRNESS_HEADER
from infergate.epp.flowcontrol.saturation import SaturationDetector
from infergate.epp.framework.requestcontrol import ResponseInfo
from infergate.epp.observability import EppMetrics
from infergate.epp.requestcontrol.director import Director, Rejected
from infergate.epp.scheduling.plugins import PluginContext
from infergate.epp.scheduling.scheduler import Scheduler
from infergate.epp.types import Endpoint, InferenceRequest

FLOW = "flowControl: {maxRequestsPerEndpoint: 1, useSaturationDetector: false, "


def make_director(flow_yaml: str | None) -> Director:
    datastore = Datastore()
    datastore.set_endpoints([Endpoint("127.0.0.1", 8000)])
    saturation = SaturationDetector(5, 0.8, 2.0)
    metrics = EppMetrics(datastore, saturation)
    context = PluginContext(datastore, saturation, {"metrics": metrics})
    scheduler = Scheduler.from_config(load_config(None), context, metrics.plugin_timer)
    flow_config = parse_config(flow_yaml).flowControl if flow_yaml else None
    flow = build_flow_controller(flow_config, datastore, saturation, metrics)
    return Director(datastore, scheduler, saturation, ObjectiveStore(), metrics, flow)


def body(prompt: str = "hi") -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, "max_tokens": 4}).encode()


def request(tenant: str | None = None) -> InferenceRequest:
    headers = {FAIRNESS_HEADER: tenant} if tenant else {}
    return InferenceRequest(request_id="r", headers=headers)


def done(tokens: int = 10) -> ResponseInfo:
    return ResponseInfo(status=200, complete=True, prompt_tokens=tokens, completion_tokens=4)


async def test_off_by_default_is_shed_or_pass() -> None:
    director = make_director(None)
    assert director.flow is None
    decision = await director.route(request(), body(), None)
    assert decision.ticket is None
    director.finish(decision, done())


async def test_queued_request_is_scheduled_when_the_first_finishes() -> None:
    director = make_director(FLOW + "defaultRequestTTL: 5s}")
    assert director.flow is not None
    first = await director.route(request(), body(), None)
    assert first.ticket is not None and director.flow.in_flight == 1
    second = asyncio.create_task(director.route(request("b"), body(), None))
    await asyncio.sleep(0.01)
    assert not second.done() and len(director.flow.queues) == 1
    # A request without a body is not inference work: never queued.
    bodiless = await director.route(request(), None, None)
    assert bodiless.ticket is None
    director.finish(bodiless, ResponseInfo(status=200, complete=True))
    director.finish(first, done())
    decision = await asyncio.wait_for(second, 2.0)
    assert decision.destination == "127.0.0.1:8000"
    director.finish(decision, done())
    director.finish(decision, done())  # a second finish releases nothing more
    assert director.flow.in_flight == 0 and len(director.flow.queues) == 0


async def test_ttl_becomes_429_with_its_reason() -> None:
    director = make_director(FLOW + "defaultRequestTTL: 50ms}")
    held = await director.route(request(), body(), None)
    with pytest.raises(Rejected) as error:
        await director.route(request(), body(), None)
    assert error.value.status == 429 and error.value.message.startswith("ttl_expired: ")
    director.finish(held, done())
    assert director.flow is not None and director.flow.in_flight == 0


async def test_queue_full_becomes_429_with_its_reason() -> None:
    director = make_director(FLOW + "maxRequests: 1, defaultRequestTTL: 5s}")
    held = await director.route(request(), body(), None)
    waiting = asyncio.create_task(director.route(request(), body(), None))
    await asyncio.sleep(0.01)
    with pytest.raises(Rejected) as error:
        await director.route(request(), body(), None)
    assert error.value.status == 429 and error.value.message.startswith("queue_full: ")
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    director.finish(held, done())
    assert director.flow is not None and director.flow.in_flight == 0


async def test_no_candidate_after_the_wait_gives_the_capacity_back() -> None:
    director = make_director(FLOW + "defaultRequestTTL: 5s}")
    held = await director.route(request(), body(), None)
    waiting = asyncio.create_task(director.route(request(), body(), ["127.0.0.1:8000"]))
    await asyncio.sleep(0.01)
    assert director.flow is not None and len(director.flow.queues) == 1
    # While it waits, the pool changes: its subset's only endpoint is gone.
    director.datastore.set_endpoints([Endpoint("127.0.0.1", 8001)])
    director.finish(held, done())
    with pytest.raises(Rejected) as error:
        await waiting
    assert error.value.status == 503 and "subset" in error.value.message
    assert director.flow.in_flight == 0 and len(director.flow.queues) == 0


async def test_token_fair_share_is_charged_the_usage_read_from_the_response() -> None:
    director = make_director(FLOW + "fairnessPolicy: token-fair-share}")
    assert director.flow is not None
    decision = await director.route(request("a"), body("x" * 400), None)
    # Charged at dispatch: 400-odd body bytes / 4 + max_tokens 4.
    estimate = director.flow.queues.history[(0, "a")]
    assert 100 < estimate < 120
    director.finish(decision, done(tokens=1000))  # 1000 prompt + 4 completion tokens
    assert director.flow.queues.history[(0, "a")] == pytest.approx(1004)
