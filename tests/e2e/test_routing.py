"""Requests through the real Envoy, routed by the real EPP, served by real (simulated) engines.

What is checked is what a user would see: the engine that served (Envoy's
``%UPSTREAM_HOST%`` in ``x-infergate-upstream-host``) against the EPP's own decision (the
``x-gateway-destination-endpoint`` it set, echoed as ``x-infergate-picked-endpoint``) and
the engines' own Prometheus counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator

import httpx
import openai

from infergate.envoy.bootstrap import (
    EPP_CLUSTER,
    PICKED_HEADER,
    SERVED_HEADER,
    UPSTREAM_HOST_HEADER,
)
from infergate.envoy.process import start_envoy
from infergate.procs import free_port
from infergate.stack.local import LocalStack
from tests.support.probes import engines_idle, envoy_cluster_healthy, metric_sum, wait_for

OBJECTIVE_HEADER = "x-gateway-inference-objective"
SHEDDABLE = "batch-sheddable"  # priority -1 in the stack's objectives file (conftest)
MAX_BODY_BYTES = 64 * 1024  # the stack's --max-request-body-bytes (conftest)


def _complete(
    stack: LocalStack, prompt: str, *, headers: dict[str, str] | None = None, max_tokens: int = 4
) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/v1/completions",
        json={"model": stack.model_name, "prompt": prompt, "max_tokens": max_tokens},
        headers=headers or {},
        timeout=60,
    )


def _served_by(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.headers[UPSTREAM_HOST_HEADER]


def _successes(stack: LocalStack) -> dict[str, float]:
    return {
        address: metric_sum(f"http://{address}/metrics", "vllm:request_success_total")
        for address in stack.engine_addresses
    }


@contextlib.asynccontextmanager
async def _flood(stack: LocalStack, addresses: list[str], per_engine: int) -> AsyncIterator[None]:
    """Queue long requests directly on ``addresses`` (bypassing Envoy) until each engine
    reports a deep waiting queue; cancel them all on exit and wait for the engines to idle."""
    client = httpx.AsyncClient(timeout=120)
    body = {"model": stack.model_name, "prompt": "busy " * 20, "max_tokens": 2000}
    tasks = [
        asyncio.create_task(client.post(f"http://{address}/v1/completions", json=body))
        for address in addresses
        for _ in range(per_engine)
    ]

    def queued() -> bool:
        return all(
            metric_sum(f"http://{a}/metrics", "vllm:num_requests_waiting") >= per_engine - 2
            for a in addresses
        )

    try:
        await asyncio.to_thread(wait_for, queued, 60.0, "engine queues to fill")
        # ...and until the EPP has scraped those queues (it polls every 50 ms).
        await asyncio.to_thread(
            wait_for,
            lambda: all(
                metric_sum(stack.epp_metrics_url, "infergate_epp_endpoint_queue_size", endpoint=a)
                >= per_engine - 2
                for a in addresses
            ),
            30.0,
            "the EPP to see the queues",
        )
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.aclose()
        await asyncio.to_thread(
            wait_for, lambda: engines_idle(stack.engine_urls), 60.0, "engines to go idle"
        )


def test_streaming_chat_reaches_the_engine_the_epp_chose(stack: LocalStack) -> None:
    before = _successes(stack)
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=stack.model_name,
        messages=[{"role": "user", "content": f"hello {uuid.uuid4()}"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    served = raw.headers[UPSTREAM_HOST_HEADER]  # where Envoy connected
    assert raw.headers[PICKED_HEADER].split(",")[0] == served  # the EPP's first choice
    assert raw.headers[SERVED_HEADER] == served  # what Envoy told the EPP, echoed by it
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = next(c.usage for c in chunks if c.usage)
    assert usage.completion_tokens == 8
    assert text
    wait_for(
        lambda: _successes(stack)[served] == before[served] + 1, 10, "the served engine's count"
    )
    others = [a for a in stack.engine_addresses if a != served]
    assert all(_successes(stack)[a] == before[a] for a in others)


def test_server_sent_events_stream_through_without_buffering(stack: LocalStack) -> None:
    """Envoy and the EPP (FULL_DUPLEX_STREAMED responses) pass each SSE chunk on as it
    comes: the client sees the first token long before the last one is generated."""
    body = {
        "model": stack.model_name,
        "prompt": f"{uuid.uuid4()} tell a long story",
        "max_tokens": 64,
        "ignore_eos": True,
        "stream": True,
    }
    arrivals: list[float] = []
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        started = time.perf_counter()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter() - started)
    assert len(arrivals) == 64
    # 64 decode steps of the simulated engine: were the stream buffered anywhere, every
    # chunk would arrive together at the end.
    assert arrivals[0] < 0.5 * arrivals[-1]


def test_shared_prefix_sticks_while_unrelated_prompts_spread(stack: LocalStack) -> None:
    system = f"You are assistant {uuid.uuid4()}. " + "Follow the long house rules. " * 80
    sticky = {_served_by(_complete(stack, f"{system}\nQuestion {i}?")) for i in range(8)}
    assert len(sticky) == 1, f"one shared prefix went to {sticky}"

    spread = Counter(
        _served_by(_complete(stack, f"{uuid.uuid4()} {i} " + "unrelated words " * 20))
        for i in range(16)
    )
    assert len(spread) == len(stack.engine_addresses), f"unrelated prompts all went to {spread}"


async def test_an_engine_with_a_long_queue_is_avoided(stack: LocalStack) -> None:
    busy, idle = stack.engine_addresses
    async with _flood(stack, [busy], per_engine=9):
        served = Counter(
            [
                _served_by(await asyncio.to_thread(_complete, stack, f"{uuid.uuid4()} fresh"))
                for _ in range(8)
            ]
        )
    assert served == Counter({idle: 8})


async def test_sheddable_requests_get_429_when_the_pool_is_saturated(stack: LocalStack) -> None:
    shed = {OBJECTIVE_HEADER: SHEDDABLE}
    assert (await asyncio.to_thread(_complete, stack, "calm pool", headers=shed)).status_code == 200
    async with _flood(stack, stack.engine_addresses, per_engine=9):
        rejected = await asyncio.to_thread(_complete, stack, "saturated pool", headers=shed)
        assert rejected.status_code == 429
        assert "saturated" in rejected.json()["error"]["message"]
        # Critical traffic is never shed: the EPP still routes it (the saturation filter
        # fails open). It then waits behind the flood, so do not wait for its answer.
        routed = metric_sum(stack.epp_metrics_url, "infergate_epp_requests_total", outcome="routed")
        with contextlib.suppress(httpx.TimeoutException):
            kept = await asyncio.to_thread(
                httpx.post,
                f"{stack.base_url}/v1/completions",
                json={"model": stack.model_name, "prompt": "critical", "max_tokens": 1},
                headers={OBJECTIVE_HEADER: "interactive"},
                timeout=3,
            )
            assert kept.status_code == 200
        assert (
            metric_sum(stack.epp_metrics_url, "infergate_epp_requests_total", outcome="routed")
            == routed + 1
        )


def test_requests_without_a_body_are_routed_at_header_time(stack: LocalStack) -> None:
    models = httpx.get(f"{stack.base_url}/v1/models", timeout=30)
    assert models.headers[UPSTREAM_HOST_HEADER] in stack.engine_addresses
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["data"]] == [stack.model_name]
    health = httpx.get(f"{stack.base_url}/health", timeout=30)
    assert health.status_code == 200


def test_bad_bodies_get_400_and_413_and_the_epp_keeps_serving(stack: LocalStack) -> None:
    url = f"{stack.base_url}/v1/completions"
    with httpx.Client(timeout=60) as client:
        malformed = client.post(
            url,
            content=b'{"model": "tiny", "prompt": ',
            headers={"content-type": "application/json"},
        )
        assert malformed.status_code == 400
        assert malformed.json()["error"]["code"] == 400
        not_an_object = client.post(url, json=["a", "list"])
        assert not_an_object.status_code == 400
        huge = client.post(
            url, json={"model": stack.model_name, "prompt": "x" * (MAX_BODY_BYTES + 1024)}
        )
        assert huge.status_code == 413
    for i in range(3):
        _served_by(_complete(stack, f"still serving {i}"))
    assert metric_sum(stack.epp_metrics_url, "infergate_epp_requests_total") > 0


def test_an_endpoint_removed_from_the_file_gets_no_more_traffic(stack: LocalStack) -> None:
    keep, drop = stack.engine_addresses

    def pool_size() -> float:
        return metric_sum(stack.epp_metrics_url, "infergate_epp_pool_endpoints")

    stack.write_endpoints([keep])
    try:
        wait_for(lambda: pool_size() == 1, 30, "the EPP to reload the endpoints file")
        before = _successes(stack)[drop]
        served = {_served_by(_complete(stack, f"{uuid.uuid4()} after removal")) for _ in range(8)}
        assert served == {keep}
        assert _successes(stack)[drop] == before
    finally:
        stack.write_endpoints(stack.engine_addresses)
        wait_for(lambda: pool_size() == 2, 30, "the EPP to re-add the endpoint")


def test_an_engine_with_stale_metrics_is_avoided_until_it_recovers(stack: LocalStack) -> None:
    fresh, frozen = stack.engine_addresses
    frozen_process = stack.engines[stack.engine_addresses.index(frozen)]

    def stale(address: str) -> float:
        return metric_sum(
            stack.epp_metrics_url, "infergate_epp_endpoint_metrics_stale", endpoint=address
        )

    os.kill(frozen_process.pid, signal.SIGSTOP)  # alive but silent: scrapes time out
    try:
        wait_for(lambda: stale(frozen) == 1, 30, "the EPP to mark the frozen engine stale")
        served = {_served_by(_complete(stack, f"{uuid.uuid4()} while frozen")) for _ in range(6)}
        assert served == {fresh}
    finally:
        os.kill(frozen_process.pid, signal.SIGCONT)
    wait_for(lambda: stale(frozen) == 0, 30, "fresh metrics from the thawed engine")
    spread = {_served_by(_complete(stack, f"{uuid.uuid4()} thawed {i}")) for i in range(16)}
    assert frozen in spread


def _epp_healthy(admin_url: str) -> bool:
    return envoy_cluster_healthy(admin_url, EPP_CLUSTER)


def test_with_the_epp_down_fail_open_serves_and_fail_close_refuses(stack: LocalStack) -> None:
    """Last in the module: it stops and restarts the shared EPP."""
    open_port, open_admin = free_port(), free_port()
    start_envoy(
        stack.group,
        stack.envoy_config(listen_port=open_port, admin_port=open_admin, failure_mode_allow=True),
        stack.envoy_config_file.with_name("envoy-failopen.yaml"),
        name="envoy-failopen",
    )
    # A FailOpen listener with no static fallback list (as the operator's sidecar): it
    # fails open over the endpoints the EPP last announced over EDS.
    eds_port, eds_admin = free_port(), free_port()
    start_envoy(
        stack.group,
        stack.envoy_config(
            listen_port=eds_port,
            admin_port=eds_admin,
            failure_mode_allow=True,
            fallback_endpoints=(),
        ),
        stack.envoy_config_file.with_name("envoy-failopen-eds.yaml"),
        name="envoy-failopen-eds",
    )
    fail_open = f"http://127.0.0.1:{open_port}/v1/completions"
    fail_open_eds = f"http://127.0.0.1:{eds_port}/v1/completions"
    body = {"model": stack.model_name, "prompt": "is anyone there", "max_tokens": 2}
    assert httpx.post(fail_open, json=body, timeout=60).status_code == 200
    assert httpx.post(fail_open_eds, json=body, timeout=60).status_code == 200

    admins = {f"http://127.0.0.1:{p}" for p in (open_admin, eds_admin, stack.spec.admin_port)}
    stack.stop_epp()
    try:
        # Envoy fails open on a body-carrying request only once its health check has seen
        # the EPP go (see envoy_config): at most one check interval (1 s) later.
        wait_for(lambda: not any(_epp_healthy(a) for a in admins), 30, "Envoy to see the EPP down")
        with httpx.Client(timeout=60) as client:
            refused = client.post(f"{stack.base_url}/v1/completions", json=body)
            assert 500 <= refused.status_code < 600
            # (Envoy's workers see the health change a moment after its admin does.)
            for url in (fail_open, fail_open_eds):

                def serves(url: str = url) -> bool:
                    return client.post(url, json=body).status_code == 200

                wait_for(serves, 10, f"{url} to serve without the EPP")
                served = client.post(url, json=body)
                assert served.status_code == 200, served.text
                assert served.headers[UPSTREAM_HOST_HEADER] in stack.engine_addresses
                assert served.json()["usage"]["completion_tokens"] == 2
    finally:
        stack.start_epp()
    wait_for(lambda: all(_epp_healthy(a) for a in admins), 30, "Envoy to see the EPP back")
    # Envoy's workers pick up the health change a moment after its admin reports it.
    wait_for(
        lambda: _complete(stack, "the EPP is back").status_code == 200, 30, "routing to resume"
    )
