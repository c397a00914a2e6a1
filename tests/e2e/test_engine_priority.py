"""The InferenceObjective's priority, end to end, ordering the engine's own queue.

Real Envoy, the real EPP (no flow control: everything goes straight to the engine) and
one simulated engine with ``--scheduling-policy priority --max-num-seqs 1``. A first
request holds the engine's only slot while background requests (no objective) and then
a ``critical`` one (objective priority 10) queue *in the engine*; the hold is released
(its client leaves, which aborts it) and the critical request's first token must come
before every background one's — the EPP's ``x-infergate-priority: -10`` header, through
Envoy, is what put it first. Order, not time, is asserted.

Priority is the pool owner's: a client's body ``"priority": -100`` (vLLM's convention)
does not overtake ``critical`` unless the EPP runs with ``--client-priority-max``, and
then only up to that bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infergate.stack.local import LocalStack, StackSpec
from tests.support.probes import metric_sum

OBJECTIVES = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: critical}
spec: {priority: 10, poolRef: {name: local}}
"""


def _stack(workdir: Path, tiny_model: Path, epp_args: list[str]) -> LocalStack:
    (workdir / "objectives.yaml").write_text(OBJECTIVES)
    spec = StackSpec.on_free_ports(
        engines=1,
        model=tiny_model,
        served_model_name="tiny",
        simulate=True,
        objectives_file=workdir / "objectives.yaml",
        engine_args=["--max-num-seqs", "1", "--scheduling-policy", "priority"],
        epp_args=epp_args,
        access_log=False,
        workdir=workdir,
        start_timeout=180.0,
    )
    return LocalStack(spec)


@pytest.fixture(scope="module")
def priority_stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[LocalStack]:
    with _stack(tmp_path_factory.mktemp("engine-priority"), tiny_model, []) as running:
        yield running


@pytest.fixture(scope="module")
def opted_in_stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[LocalStack]:
    """The pool's owner lets clients set their priority, up to 5 (below ``critical``)."""
    workdir = tmp_path_factory.mktemp("engine-priority-opted-in")
    with _stack(workdir, tiny_model, ["--client-priority-max", "5"]) as running:
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


async def _first_token_order(
    stack: LocalStack, calls: list[tuple[str, str | None, int | None]]
) -> list[str]:
    """Send ``calls`` (name, objective, body priority) one by one, each once the engine
    holds the ones before it; release the first (the hold); the order of first tokens."""
    url = f"{stack.base_url}/v1/completions"
    first_token: dict[str, float] = {}
    release = asyncio.Event()

    async def call(
        client: httpx.AsyncClient, name: str, objective: str | None, priority: int | None
    ) -> None:
        hold = name == "hold"
        body = {"model": "tiny", "prompt": f"request {name}", "stream": True,
                "max_tokens": 1000 if hold else 8, "ignore_eos": True}  # fmt: skip
        if priority is not None:
            body["priority"] = priority
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
        tasks = []
        for k, (name, objective, priority) in enumerate(calls):
            tasks.append(asyncio.create_task(call(client, name, objective, priority)))
            await _wait_held(stack, k + 1)
        release.set()
        await asyncio.gather(*tasks)
    return sorted(first_token, key=first_token.__getitem__)


BACKGROUND: list[tuple[str, str | None, int | None]] = [
    ("hold", None, None), ("bg0", None, None), ("bg1", None, None), ("bg2", None, None)
]  # fmt: skip
#: A client asking for vLLM priority -100 in its body (far more urgent than critical's -10).
ROGUE = ("rogue", None, -100)
CRITICAL = ("critical", "critical", None)


async def test_objective_priority_orders_the_engine_queue(priority_stack: LocalStack) -> None:
    order = await _first_token_order(priority_stack, [*BACKGROUND, CRITICAL])
    assert order == ["hold", "critical", "bg0", "bg1", "bg2"]


async def test_body_priority_does_not_beat_the_objective(priority_stack: LocalStack) -> None:
    """The pool has not opted in: the rogue's body priority is removed, it waits its turn
    (priority 0, after the background requests that came first)."""
    order = await _first_token_order(priority_stack, [*BACKGROUND, ROGUE, CRITICAL])
    assert order == ["hold", "critical", "bg0", "bg1", "bg2", "rogue"]


async def test_opted_in_pool_clamps_body_priority(opted_in_stack: LocalStack) -> None:
    """Opted in up to 5: the rogue passes the background requests (0) but, clamped to 5,
    not the critical objective (10)."""
    order = await _first_token_order(opted_in_stack, [*BACKGROUND, ROGUE, CRITICAL])
    assert order == ["hold", "critical", "rogue", "bg0", "bg1", "bg2"]
