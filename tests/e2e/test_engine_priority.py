"""The InferenceObjective's priority, end to end, ordering the engine's own queue.

Real Envoy, the real EPP (no flow control: everything goes straight to the engine) and
one simulated engine with ``--scheduling-policy priority --max-num-seqs 1``. A first
request holds the engine's only slot while background requests (no objective) and then
a ``critical`` one (objective priority 10) queue *in the engine*; the hold is released
(its client leaves, which aborts it) and the critical request's first token must come
before every background one's — the EPP's ``x-infergate-priority: -10`` header, through
Envoy, is what put it first. Order, not time, is asserted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infergate.stack.local import LocalStack, StackSpec
from infergate.stack.probes import metric_sum

OBJECTIVES = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: critical}
spec: {priority: 10, poolRef: {name: local}}
"""


@pytest.fixture(scope="module")
def priority_stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[LocalStack]:
    workdir = tmp_path_factory.mktemp("engine-priority")
    (workdir / "objectives.yaml").write_text(OBJECTIVES)
    spec = StackSpec.on_free_ports(
        engines=1,
        model=tiny_model,
        served_model_name="tiny",
        simulate=True,
        objectives_file=workdir / "objectives.yaml",
        engine_args=["--max-num-seqs", "1", "--scheduling-policy", "priority"],
        access_log=False,
        workdir=workdir,
        start_timeout=180.0,
    )
    with LocalStack(spec) as running:
        yield running


async def _held(stack: LocalStack) -> float:
    url = f"{stack.engine_urls[0]}/metrics"
    running = await asyncio.to_thread(metric_sum, url, "vllm:num_requests_running")
    waiting = await asyncio.to_thread(metric_sum, url, "vllm:num_requests_waiting")
    return running + waiting


async def _wait_held(stack: LocalStack, count: int) -> None:
    for _ in range(600):
        if await _held(stack) >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the engine never held {count} requests")


async def test_objective_priority_orders_the_engine_queue(priority_stack: LocalStack) -> None:
    url = f"{priority_stack.base_url}/v1/completions"
    first_token: dict[str, float] = {}
    release = asyncio.Event()

    async def call(client: httpx.AsyncClient, name: str, objective: str | None) -> None:
        hold = name == "hold"
        body = {"model": "tiny", "prompt": f"request {name}", "stream": True,
                "max_tokens": 1000 if hold else 8, "ignore_eos": True}  # fmt: skip
        headers = {"x-gateway-inference-objective": objective} if objective else {}
        async with client.stream("POST", url, json=body, headers=headers) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data: {") and name not in first_token:
                    first_token[name] = time.monotonic()
                if hold and release.is_set():
                    return  # leaving the stream aborts it (Envoy resets the upstream)

    limits = httpx.Limits(max_connections=20, max_keepalive_connections=20)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        calls = [("hold", None), ("bg0", None), ("bg1", None), ("bg2", None),
                 ("critical", "critical")]  # fmt: skip
        tasks = []
        for k, (name, objective) in enumerate(calls):
            tasks.append(asyncio.create_task(call(client, name, objective)))
            await _wait_held(priority_stack, k + 1)
        release.set()
        await asyncio.gather(*tasks)
    order = sorted(first_token, key=first_token.__getitem__)
    assert order == ["hold", "critical", "bg0", "bg1", "bg2"]
