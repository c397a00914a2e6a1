"""Precise prefix mode: a real ZMQ PUB sending vLLM-format KV events, and a real engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import msgspec
import zmq
import zmq.asyncio
from infergate.epp.config import parse_config
from infergate.epp.options import ENGINE_API_KEY_ENV
from infergate.epp.scheduling.plugins.precise_prefix import KV_EVENTS_PORT_LABEL
from infergate.epp.types import CycleState, Endpoint, InferenceRequest

from infergate.procs import free_port, http_ready
from infergate.wire.block_hash import block_hashes

from .conftest import Stream, body, eventually, headers, set_headers

CONFIG = """
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-scorer
  parameters: {blockSize: 4}
- type: prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: precise-prefix-cache-scorer, weight: 1}
  - pluginRef: max-score-picker
"""


def batch(*events: Sequence[object]) -> bytes:
    """A vLLM KVEventBatch: ``[ts, [tagged events…], data_parallel_rank]``."""
    return msgspec.msgpack.encode([time.time(), list(events), 0])


async def _score(plugin, tokens: list[int], states) -> list[float]:
    request = InferenceRequest("r", {}, body={"prompt": tokens}, target_model="m")
    cycle = CycleState()
    await plugin.prepare(cycle, request, states)
    return plugin.score(cycle, request, states)


async def test_index_follows_stored_removed_cleared(epp_factory) -> None:
    kv_port = free_port()
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{kv_port}")
    a = Endpoint("127.0.0.1", 18101, ((KV_EVENTS_PORT_LABEL, str(kv_port)),))
    b = Endpoint("127.0.0.1", 18102, ((KV_EVENTS_PORT_LABEL, str(free_port())),))
    try:
        epp = await epp_factory(static_endpoints=[a, b], config=parse_config(CONFIG))
        plugin = epp.scheduler.plugins["precise-prefix-cache-scorer"]
        states = [epp.datastore.get(a.key), epp.datastore.get(b.key)]
        tokens = list(range(100, 112))  # three blocks of four
        hashes = block_hashes(tokens, 4)
        stored = ["BlockStored", hashes, None, tokens, 4, None, "GPU", None]
        seq = 0

        async def publish_until(check) -> None:
            nonlocal seq
            for _ in range(200):  # ZMQ subscribers join late: repeat until seen
                await pub.send_multipart([b"", seq.to_bytes(8, "big"), current])
                seq += 1
                await asyncio.sleep(0.02)
                if check():
                    return
            raise AssertionError("event never applied")

        current = batch(stored)
        await publish_until(lambda: plugin.index.holders.get(hashes[0]) == {a.key})
        assert await _score(plugin, tokens, states) == [1.0, 0.0]
        assert await _score(plugin, [*tokens[:8], 1, 2, 3, 4], states) == [2 / 3, 0.0]

        current = batch(["BlockRemoved", [hashes[1]], "GPU"])
        await publish_until(lambda: hashes[1] not in plugin.index.holders)
        assert await _score(plugin, tokens, states) == [1 / 3, 0.0]  # leading run breaks at block 1

        approximate = epp.scheduler.plugins["prefix-cache-scorer"]
        approximate.index.add(a.key, [1, 2, 3])
        approximate.index.add(b.key, [1, 2])
        current = batch(["AllBlocksCleared"])
        await publish_until(lambda: not plugin.index.holders)
        assert await _score(plugin, tokens, states) == [0.0, 0.0]
        # The real eviction corrects the approximate index too (only for that engine).
        assert approximate.index.size(a.key) == 0
        assert approximate.index.size(b.key) == 2

        # Garbage on the wire is logged and skipped; the subscriber keeps going.
        current = b"\xc1not msgpack"
        await pub.send_multipart([b"", b"\0" * 8, current])
        current = batch(stored)
        await publish_until(lambda: hashes[0] in plugin.index.holders)
    finally:
        pub.close(0)
        context.term()


async def test_real_engine_metrics_events_and_tokenize(
    processes, infergate_cli, tiny_model, epp_factory
) -> None:
    import httpx

    port, kv_port = free_port(), free_port()
    processes.start(
        "engine-sim",
        [
            *infergate_cli, "engine", "serve", str(tiny_model), "--port", str(port),
            "--served-model-name", "tiny", "--simulate", "--kv-events-port", str(kv_port),
            "--num-gpu-blocks-override", "256", "--max-model-len", "1024",
        ],
        ready=http_ready(f"http://127.0.0.1:{port}/health"),
        timeout=120,
    )  # fmt: skip
    engine = Endpoint("127.0.0.1", port, ((KV_EVENTS_PORT_LABEL, str(kv_port)),))
    config = CONFIG.replace("parameters: {blockSize: 4}", "parameters: {}")  # learnt: 16
    epp = await epp_factory(static_endpoints=[engine], config=parse_config(config))
    state = epp.datastore.get(engine.key)
    assert state is not None
    await eventually(lambda: state.metrics.block_size == 16, timeout=30)  # vllm:cache_config_info
    plugin = epp.scheduler.plugins["precise-prefix-cache-scorer"]
    await asyncio.sleep(0.3)  # let the SUB socket join before the engine publishes

    prompt = "The quick brown fox jumps over the lazy dog. " * 12
    async with httpx.AsyncClient(timeout=60) as client:
        response = await client.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 2},
        )
        assert response.status_code == 200, response.text
    await eventually(lambda: bool(plugin.index.by_endpoint.get(engine.key)), timeout=30)

    request = InferenceRequest(
        "r", {}, body={"model": "tiny", "prompt": prompt}, target_model="tiny"
    )
    cycle = CycleState()
    await plugin.prepare(cycle, request, [state])
    assert cycle["precise.hashes"], "the engine's /tokenize gave no tokens"
    assert plugin.score(cycle, request, [state]) == [1.0]  # every full block is cached there

    # And the whole path through the ext-proc server routes to it.
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as channel:
        stream = Stream(channel)
        payload = httpx.Request(
            "POST", "http://x", json={"model": "tiny", "prompt": prompt}
        ).content
        await stream.send(headers({":method": "POST", ":path": "/v1/completions"}), body(payload))
        header_response, _ = await stream.recv(2)
        assert set_headers(header_response)["x-gateway-destination-endpoint"] == engine.key


async def test_tokenize_carries_the_engines_api_key(
    processes, infergate_cli, tiny_model, epp_factory, monkeypatch, caplog
) -> None:
    """An engine started with --api-key refuses /tokenize without the key: each refusal is
    counted (``infergate_epp_tokenize_errors_total{reason="unauthorized"}``) and logged
    once per endpoint per 30 s. The key comes from ``INFERGATE_ENGINE_API_KEY`` (``up`` and
    the operator set it) or the variable the scorer's ``apiKeyEnv`` names."""
    import logging

    import httpx

    monkeypatch.delenv(ENGINE_API_KEY_ENV, raising=False)

    port = free_port()
    processes.start(
        "engine-keyed",
        [
            *infergate_cli, "engine", "serve", str(tiny_model), "--port", str(port),
            "--served-model-name", "tiny", "--simulate", "--api-key", "s3cret-key",
            "--num-gpu-blocks-override", "256", "--max-model-len", "1024",
        ],
        ready=http_ready(f"http://127.0.0.1:{port}/health"),
        timeout=120,
    )  # fmt: skip
    prompt = "The quick brown fox jumps over the lazy dog. " * 12
    async with httpx.AsyncClient(timeout=30) as client:  # the engine really needs the key
        refused = await client.post(
            f"http://127.0.0.1:{port}/tokenize", json={"model": "tiny", "prompt": prompt}
        )
    assert refused.status_code == 401

    engine = Endpoint("127.0.0.1", port, ((KV_EVENTS_PORT_LABEL, str(free_port())),))
    request = InferenceRequest(
        "r", {}, body={"model": "tiny", "prompt": prompt}, target_model="tiny"
    )

    async def hashes(params: str, times: int = 1) -> list[int]:
        config = parse_config(CONFIG.replace("{blockSize: 4}", params))
        epp = await epp_factory(static_endpoints=[engine], config=config)
        state = epp.datastore.get(engine.key)
        assert state is not None
        epps.append(epp)
        for _ in range(times):
            cycle = CycleState()
            plugin = epp.scheduler.plugins["precise-prefix-cache-scorer"]
            await plugin.prepare(cycle, request, [state])
        return list(cycle["precise.hashes"])

    epps: list = []
    with caplog.at_level(logging.WARNING, logger="infergate.epp.precise_prefix"):
        assert await hashes("{blockSize: 16}", times=3) == []  # no key: refused, no score
    refused_count = epps[0].metrics.registry.get_sample_value(
        "infergate_epp_tokenize_errors_total", {"reason": "unauthorized"}
    )
    assert refused_count == 3
    lines = [r.getMessage() for r in caplog.records if "/tokenize failed" in r.getMessage()]
    assert len(lines) == 1 and "HTTP 401" in lines[0] and ENGINE_API_KEY_ENV in lines[0]
    monkeypatch.setenv(ENGINE_API_KEY_ENV, "s3cret-key")  # what `up` and the operator set
    assert len(await hashes("{blockSize: 16}")) >= 5
    monkeypatch.delenv(ENGINE_API_KEY_ENV)
    monkeypatch.setenv("ENGINE_KEY", "wrong")
    assert await hashes("{blockSize: 16, apiKeyEnv: ENGINE_KEY}") == []
    monkeypatch.setenv("ENGINE_KEY", "s3cret-key")
    got = await hashes("{blockSize: 16, apiKeyEnv: ENGINE_KEY}")
    assert len(got) >= 5  # ~100 tokens: every full 16-token block hashed
