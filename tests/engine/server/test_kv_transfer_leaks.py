"""No KV block leaks on either side of P/D: 1,000 disaggregated requests, random aborts.

Two simulated engines (a ``kv_producer`` and a ``kv_consumer``, fast timing) and a client
that sends every request to the decode engine with ``x-prefiller-host-port`` naming the
prefill engine, and abandons about a third of them at a random moment (while the prefill
runs, while the KV is pulled, mid-decode, mid-stream). Afterwards both engines are idle
with every block free, and the prefill engine holds nothing — what was never pulled was
freed by the abort timeout.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infergate.procs import ProcessGroup, free_port, http_ready

API_KEY = "test-key"
MODEL = "tiny"

REQUESTS = 1000
CONCURRENCY = 24
FAST = ["--simulate", "--sim-base-ms", "1", "--sim-us-per-token", "2", "--sim-us-per-seq", "5"]


@dataclass
class Server:
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
        return out

    def gauge(self, name: str) -> float:
        return self.metrics()[f"{name}{{model_name={MODEL}}}"]

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until nothing runs or waits and every KV block is free (usage 0)."""
        deadline = time.monotonic() + timeout
        names = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc")  # fmt: skip
        while (busy := tuple(self.gauge(n) for n in names)) != (0, 0, 0):
            if time.monotonic() > deadline:
                raise AssertionError(f"engine still busy (running, waiting, usage) = {busy}")
            time.sleep(0.05)


def _start(group: ProcessGroup, cli: list[str], name: str, model_dir: Path, *extra: str) -> Server:
    port = free_port()
    argv = [*cli, "engine", "serve", str(model_dir), "--port", str(port),
            "--served-model-name", MODEL, "--api-key", API_KEY, *extra]  # fmt: skip
    group.start(name, argv, ready=http_ready(f"http://127.0.0.1:{port}/health"), timeout=120)
    return Server(port)


@pytest.fixture(scope="module")
def pd_pair(tiny_model_dir: Path, infergate_cli: list[str]) -> Iterator[tuple[Server, Server]]:
    def config(role: str) -> str:
        return json.dumps(
            {
                "kv_connector": "ZmqConnector",
                "kv_role": role,
                "kv_port": free_port(),
                "kv_connector_extra_config": {"abort_timeout_s": 2, "pull_timeout_s": 5},
            }
        )

    blocks = ["--num-gpu-blocks-override", "2048", "--max-model-len", "2048"]
    with ProcessGroup() as group:
        prefill = _start(group, infergate_cli, "engine-prefill", tiny_model_dir, *FAST, *blocks,
                         "--kv-transfer-config", config("kv_producer"))  # fmt: skip
        decode = _start(group, infergate_cli, "engine-decode", tiny_model_dir, *FAST, *blocks,
                        "--kv-transfer-config", config("kv_consumer"))  # fmt: skip
        yield prefill, decode


def counter(server: Server, name: str, outcome: str) -> float:
    return server.metrics()[f"{name}{{model_name={MODEL},outcome={outcome}}}"]


async def one(client: httpx.AsyncClient, i: int, prefiller: str, rng: random.Random) -> str:
    words = " ".join(f"w{rng.randrange(10_000)}" for _ in range(rng.randrange(150, 400)))
    body = {
        "model": MODEL,
        "prompt": f"{i}: {words}",
        "max_tokens": rng.randrange(2, 24),
        "stream": rng.random() < 0.5,
    }
    abort_after = rng.uniform(0.0, 0.08) if rng.random() < 0.35 else None

    async def send() -> str:
        if body["stream"]:
            async with client.stream(
                "POST", "/v1/completions", json=body, headers={"x-prefiller-host-port": prefiller}
            ) as response:
                async for _ in response.aiter_lines():
                    pass
                return str(response.status_code)
        response = await client.post(
            "/v1/completions", json=body, headers={"x-prefiller-host-port": prefiller}
        )
        return str(response.status_code)

    if abort_after is None:
        return await send()
    try:
        return await asyncio.wait_for(send(), timeout=abort_after)
    except TimeoutError:
        return "aborted"


async def drive(decode: Server, prefiller: str) -> list[str]:
    rng = random.Random(7)
    limit = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(
        base_url=decode.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as client:

        async def bounded(i: int) -> str:
            async with limit:
                return await one(client, i, prefiller, rng)

        return await asyncio.gather(*(bounded(i) for i in range(REQUESTS)))


@pytest.mark.slow
def test_no_leaked_blocks_after_many_disaggregated_requests_with_aborts(
    pd_pair: tuple[Server, Server],
) -> None:
    prefill, decode = pd_pair
    for server in pd_pair:
        server.wait_idle()
    outcomes = asyncio.run(drive(decode, f"127.0.0.1:{prefill.port}"))
    assert outcomes.count("aborted") > 100
    assert set(outcomes) <= {"200", "aborted"}, sorted(set(outcomes))
    pulled = counter(decode, "infergate:kv_transfer_remote_prefills_total", "pulled")
    assert pulled > REQUESTS // 2  # most requests really were disaggregated
    # Everything comes back: running requests end, unpulled prefills expire (2 s).
    deadline = time.monotonic() + 30
    while prefill.gauge("infergate:kv_transfer_held_blocks") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert prefill.gauge("infergate:kv_transfer_held_blocks") == 0
    prefill.wait_idle()
    decode.wait_idle()  # kv_cache_usage_perc 0: every block of both pools is free again
    held = counter(prefill, "infergate:kv_transfer_prefills_held_total", "held")
    expired = counter(prefill, "infergate:kv_transfer_prefills_held_total", "expired")
    fallback = counter(decode, "infergate:kv_transfer_remote_prefills_total", "fallback")
    assert held >= pulled
    print(f"aborted={outcomes.count('aborted')} held={held:.0f} pulled={pulled:.0f} "
          f"expired={expired:.0f} fallback={fallback:.0f}")  # fmt: skip
