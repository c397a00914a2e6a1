"""Flow control end to end: real Envoy, the real EPP with ``flowControl`` on, simulated
engines that are kept saturated.

The budget (2 EPP-routed requests per engine) equals the engines' batch size
(``--max-num-seqs 2``), so everything beyond four running requests waits in the EPP, where
priority and fairness decide who goes next. Assertions are about order and outcome
(who finished while whom was still waiting, which status, what state is left), not time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from infergate.stack.local import LocalStack, StackSpec
from tests.support.probes import engines_idle, metric_sum, wait_for

OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
QUEUE_SIZE = "inference_extension_flow_control_queue_size"
IN_FLIGHT = "infergate_epp_flow_control_in_flight_requests"
REJECTIONS = "infergate_epp_flow_control_rejections_total"

OBJECTIVES = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: critical}
spec: {priority: 100, poolRef: {name: local}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -1, poolRef: {name: local}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: impatient}
spec: {priority: -5, poolRef: {name: local}}
"""

EPP_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: max-score-picker
flowControl:
  maxRequestsPerEndpoint: 2
  useSaturationDetector: false
  defaultRequestTTL: 25s
  fairnessPolicy: round-robin
  priorityBands:
  - {priority: -5, requestTTL: 300ms}
"""


@pytest.fixture(scope="module")
def flow_stack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[LocalStack]:
    workdir = tmp_path_factory.mktemp("flow-control")
    (workdir / "objectives.yaml").write_text(OBJECTIVES)
    (workdir / "epp.yaml").write_text(EPP_CONFIG)
    spec = StackSpec.on_free_ports(
        engines=2,
        model=tiny_model,
        served_model_name="tiny",
        simulate=True,
        objectives_file=workdir / "objectives.yaml",
        epp_config_file=workdir / "epp.yaml",
        engine_args=["--max-num-seqs", "2"],
        access_log=False,
        workdir=workdir,
        start_timeout=180.0,
    )
    with LocalStack(spec) as running:
        yield running


def _body(max_tokens: int, prompt: str = "hello flow control") -> dict[str, object]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}


def _headers(objective: str | None = None, tenant: str | None = None) -> dict[str, str]:
    headers = {}
    if objective:
        headers[OBJECTIVE_HEADER] = objective
    if tenant:
        headers[FAIRNESS_HEADER] = tenant
    return headers


async def _metric(stack: LocalStack, name: str, **labels: str) -> float:
    return await asyncio.to_thread(metric_sum, stack.epp_metrics_url, name, **labels)


async def _wait_metric(stack: LocalStack, name: str, at_least: float, what: str) -> None:
    for _ in range(600):
        if await _metric(stack, name) >= at_least:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def _idle(stack: LocalStack) -> None:
    await asyncio.to_thread(
        wait_for, lambda: engines_idle(stack.engine_urls), 60.0, "engines to go idle"
    )
    await _wait_until_zero(stack, IN_FLIGHT)


async def _wait_until_zero(stack: LocalStack, name: str) -> None:
    for _ in range(600):
        if await _metric(stack, name) == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} never went back to 0")


@contextlib.asynccontextmanager
async def _busy(stack: LocalStack, client: httpx.AsyncClient) -> AsyncIterator[None]:
    """Fill every dispatch slot (2 engines x 2) with long requests; cancel them on exit."""
    hogs = [
        asyncio.create_task(
            client.post(f"{stack.base_url}/v1/completions", json=_body(3000, f"hog {i}"))
        )
        for i in range(4)
    ]
    try:
        await _wait_metric(stack, IN_FLIGHT, 4, "four long requests to be dispatched")
        yield
    finally:
        for task in hogs:
            task.cancel()
        await asyncio.gather(*hogs, return_exceptions=True)
        await _idle(stack)


async def test_critical_request_overtakes_a_queued_flood(flow_stack: LocalStack) -> None:
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        url = f"{flow_stack.base_url}/v1/completions"
        flood = [
            asyncio.create_task(
                client.post(url, json=_body(60, f"batch {i}"), headers=_headers("batch"))
            )
            for i in range(30)
        ]
        await _wait_metric(flow_stack, QUEUE_SIZE, 16, "the batch flood to queue in the EPP")
        queued = await _metric(flow_stack, QUEUE_SIZE)
        critical = await client.post(url, json=_body(4), headers=_headers("critical"))
        still_waiting = sum(not task.done() for task in flood)
        assert critical.status_code == 200, critical.text
        # Dispatched at the next free slot, ahead of every queued batch request: most of
        # what was queued when it arrived is still waiting when it is already done.
        assert still_waiting >= queued // 2, (still_waiting, queued)
        results = await asyncio.gather(*flood)
        assert [r.status_code for r in results] == [200] * len(flood)
    await _idle(flow_stack)
    assert await _metric(flow_stack, QUEUE_SIZE) == 0


async def test_tenants_at_ten_to_one_share_dispatches_round_robin(flow_stack: LocalStack) -> None:
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    finished: list[str] = []

    async def send(client: httpx.AsyncClient, tenant: str, i: int) -> int:
        response = await client.post(
            f"{flow_stack.base_url}/v1/completions",
            json=_body(30, f"{tenant} {i}"),
            headers=_headers(tenant=tenant),
        )
        finished.append(tenant)
        return response.status_code

    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        heavy = [asyncio.create_task(send(client, "heavy", i)) for i in range(30)]
        await _wait_metric(flow_stack, QUEUE_SIZE, 20, "the heavy tenant's burst to queue")
        light = [asyncio.create_task(send(client, "light", i)) for i in range(3)]
        codes = await asyncio.gather(*heavy, *light)
    assert codes == [200] * 33
    # Arriving after 20+ queued heavy requests, FCFS would finish the light tenant last.
    # Round robin gives it every other dispatch: its 3 requests are done within the first
    # few slots' worth of completions (4 running + 2 x 3 alternating + slack).
    last_light = max(i for i, tenant in enumerate(finished) if tenant == "light")
    assert last_light < 16, finished
    await _idle(flow_stack)


async def test_request_waiting_past_its_ttl_gets_429(flow_stack: LocalStack) -> None:
    async with httpx.AsyncClient(timeout=120) as client, _busy(flow_stack, client):
        before = await _metric(flow_stack, REJECTIONS, reason="ttl_expired")
        response = await client.post(
            f"{flow_stack.base_url}/v1/completions",
            json=_body(4),
            headers=_headers("impatient"),
        )
        assert response.status_code == 429, response.text
        assert "ttl_expired" in response.json()["error"]["message"]
        assert await _metric(flow_stack, REJECTIONS, reason="ttl_expired") == before + 1
        assert await _metric(flow_stack, QUEUE_SIZE) == 0


async def test_client_that_disconnects_while_queued_leaves_no_state(
    flow_stack: LocalStack,
) -> None:
    async with httpx.AsyncClient(timeout=120) as client, _busy(flow_stack, client):
        before = await _metric(flow_stack, REJECTIONS, reason="cancelled")
        async with httpx.AsyncClient(timeout=120) as leaving:
            waiter = asyncio.create_task(
                leaving.post(f"{flow_stack.base_url}/v1/completions", json=_body(4))
            )
            await _wait_metric(flow_stack, QUEUE_SIZE, 1, "the request to queue")
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
        # Gone from the queue while every slot is still busy: removed, not dispatched.
        await _wait_until_zero(flow_stack, QUEUE_SIZE)
        assert await _metric(flow_stack, REJECTIONS, reason="cancelled") == before + 1
        assert await _metric(flow_stack, IN_FLIGHT) == 4
    # The hogs' clients left too (mid-response): their capacity came back (_busy waits
    # for the in-flight gauge to reach 0), and nothing is queued.
    assert await _metric(flow_stack, QUEUE_SIZE) == 0
