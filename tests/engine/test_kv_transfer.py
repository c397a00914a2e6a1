"""P/D KV transfer between two real engine cores (tiny model, real tensors, real ZeroMQ).

The prefill core holds a finished ``do_remote_decode`` request's blocks; the decode core
pulls them over the ZMQ transport, commits them into its own pool and decodes. Its greedy
tokens equal one engine's, its next request with that prompt hits the prefix cache, and
every block comes back to both pools.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from infergate.engine.core.engine_core import EngineCore, RequestOutput
from infergate.engine.core.request import Request
from infergate.engine.core.scheduler import SchedulerConfig
from infergate.engine.interfaces import SamplingParams
from infergate.engine.kv_transfer.blocks import EngineHooks, KVTransfer
from infergate.engine.kv_transfer.config import KVTransferConfig
from infergate.engine.kv_transfer.connector import KVPayload, RemoteParams, TransferError
from infergate.engine.kv_transfer.zmq_connector import ZmqConnector, transfer_seconds
from infergate.engine.model_runner import TorchModelRunner

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = list(range(30, 73))  # 43 tokens: 10 full blocks of 4 + 3


def make_core(model_dir: Path, engine_id: str) -> EngineCore:
    runner = TorchModelRunner.from_model_dir(
        model_dir, block_size=BLOCK, num_blocks=64, device="cpu"
    )
    core = EngineCore(
        runner, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256)
    )
    core.kv_transfer = KVTransfer(core.kv, runner, engine_id=engine_id, abort_timeout_s=60)
    return core


def run(core: EngineCore, request: Request) -> RequestOutput:
    core.add_request(request)
    tokens: list[int] = []
    final: RequestOutput | None = None
    while core.has_work():
        for out in core.step():
            tokens += out.new_token_ids
            if out.finished:
                final = out
    assert final is not None
    final.new_token_ids = tokens
    return final


def inline_submit(
    core: EngineCore,
) -> Callable[[Callable[[EngineCore], Any]], concurrent.futures.Future[Any]]:
    """Run engine-thread calls inline (these tests drive the cores themselves)."""

    def submit(fn: Callable[[EngineCore], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_result(fn(core))
        return future

    return submit


def free_blocks(core: EngineCore) -> int:
    return core.kv.pool.num_free_blocks


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        KVTransferConfig.parse("{")
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig.parse('{"kv_connector": "ZmqConnector", "kv_role": "kv_sender"}')
    with pytest.raises(ValueError, match=r"NixlConnector.*not available"):
        KVTransferConfig.parse('{"kv_connector": "NixlConnector"}')
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\.link_bandwidth_gbps"):
        KVTransferConfig.parse(
            '{"kv_connector": "ZmqConnector", "kv_connector_extra_config": {"link_bandwidth_gbps": -1}}'
        )
    ok = KVTransferConfig.parse('{"kv_connector": "ZmqConnector", "kv_role": "kv_producer"}')
    assert ok.is_producer and not ok.is_consumer


def test_remote_params_validation() -> None:
    good = {
        "remote_request_id": "t",
        "remote_host": "0.0.0.0",
        "remote_port": 5,
        "remote_block_ids": [1],
    }
    assert RemoteParams.parse(good, fallback_host="10.1.1.1").host == "10.1.1.1"
    with pytest.raises(ValueError, match="remote_port"):
        RemoteParams.parse({**good, "remote_port": "5"}, fallback_host="h")
    with pytest.raises(ValueError, match="remote_block_ids"):
        RemoteParams.parse({**good, "remote_block_ids": ["x"]}, fallback_host="h")
    with pytest.raises(ValueError, match="remote_host"):
        RemoteParams.parse(good)


def test_transfer_seconds_math() -> None:
    assert transfer_seconds(10**9, 8.0) == pytest.approx(1.0)  # 8 Gbit over 8 Gbit/s
    assert transfer_seconds(10**9, 0.0) == 0.0


async def test_disaggregated_greedy_tokens_equal_one_engine(tiny_model_dir: Path) -> None:
    single = make_core(tiny_model_dir, "single")
    expected = run(single, Request("s", list(PROMPT), GREEDY)).new_token_ids

    prefill = make_core(tiny_model_dir, "prefill")
    decode = make_core(tiny_model_dir, "decode")
    p_free, d_free = free_blocks(prefill), free_blocks(decode)
    config = KVTransferConfig.parse('{"kv_connector": "ZmqConnector", "kv_port": 0}')
    assert prefill.kv_transfer is not None and decode.kv_transfer is not None
    producer = ZmqConnector(config)
    consumer = ZmqConnector(config)
    try:
        prefill.kv_transfer.advertise = producer.start_producer(
            EngineHooks(inline_submit(prefill), prefill.kv_transfer)
        )
        first = Request(
            "p", list(PROMPT), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        )
        first.kv_transfer_params = {"do_remote_decode": True}
        params = run(prefill, first).kv_transfer_params
        assert params is not None and params["do_remote_prefill"] is True
        assert len(params["remote_block_ids"]) == (len(PROMPT) - 1) // BLOCK
        assert free_blocks(prefill) < p_free  # held for the decode engine

        payload = await consumer.pull(RemoteParams.parse(params))
        assert payload.nbytes == len(payload.data) > 0
        assert free_blocks(prefill) == p_free  # freed once pulled
        with pytest.raises(TransferError, match="unknown or expired"):
            await consumer.pull(RemoteParams.parse(params))  # a second pull finds nothing

        decoded = Request("d", list(PROMPT), GREEDY)
        decoded.kv_payload = payload
        out = run(decode, decoded)
        assert out.new_token_ids == expected
        assert out.num_cached_tokens == 0  # transferred tokens are not local cache hits
        assert decode.kv_transfer.stats.injected_tokens == 40
        assert free_blocks(decode) == d_free

        again = run(decode, Request("d2", list(PROMPT), GREEDY))
        assert again.num_cached_tokens == 40  # the pulled blocks are in the prefix cache
        assert again.new_token_ids == expected
    finally:
        producer.close()
        consumer.close()


def test_payload_of_another_prompt_is_refused(tiny_model_dir: Path) -> None:
    prefill = make_core(tiny_model_dir, "prefill")
    decode = make_core(tiny_model_dir, "decode")
    assert prefill.kv_transfer is not None and decode.kv_transfer is not None
    first = Request("p", list(PROMPT), SamplingParams(temperature=0.0, max_tokens=1))
    first.kv_transfer_params = {"do_remote_decode": True}
    params = run(prefill, first).kv_transfer_params
    assert params is not None
    payload = prefill.kv_transfer.read(params["remote_request_id"])
    assert payload is not None
    other = Request("d", [t + 1 for t in PROMPT], GREEDY)
    other.kv_payload = payload
    d_free = free_blocks(decode)
    out = run(decode, other)  # prefilled locally, never an error
    assert out.error is None and len(out.new_token_ids) == GREEDY.max_tokens
    assert decode.kv_transfer.stats.rejected == 1
    assert free_blocks(decode) == d_free
    truncated = KVPayload(
        payload.transfer_id, "x", payload.block_hashes, payload.meta, payload.data[:-8]
    )
    same = Request("d3", list(PROMPT), GREEDY)
    same.kv_payload = truncated
    run(decode, same)
    assert decode.kv_transfer.stats.rejected == 2
    assert free_blocks(decode) == d_free


def test_unpulled_prefill_expires(tiny_model_dir: Path) -> None:
    now = [0.0]
    prefill = make_core(tiny_model_dir, "prefill")
    prefill.kv_transfer = KVTransfer(
        prefill.kv, prefill.runner, engine_id="p", abort_timeout_s=5, clock=lambda: now[0]
    )
    p_free = free_blocks(prefill)
    first = Request("p", list(PROMPT), SamplingParams(temperature=0.0, max_tokens=1))
    first.kv_transfer_params = {"do_remote_decode": True}
    run(prefill, first)
    assert prefill.kv_transfer.expire() == 0
    now[0] = 6.0
    assert prefill.kv_transfer.expire() == 1
    assert free_blocks(prefill) == p_free
    assert prefill.kv_transfer.stats.expired == 1


def test_aborted_prefill_holds_nothing(tiny_model_dir: Path) -> None:
    prefill = make_core(tiny_model_dir, "prefill")
    assert prefill.kv_transfer is not None
    p_free = free_blocks(prefill)
    first = Request("p", list(PROMPT), SamplingParams(temperature=0.0, max_tokens=1))
    first.kv_transfer_params = {"do_remote_decode": True}
    prefill.add_request(first)
    prefill.step()  # a first prefill chunk
    prefill.abort("p")
    assert prefill.kv_transfer.held == {}
    assert free_blocks(prefill) == p_free


def test_pull_from_nobody_times_out() -> None:
    config = KVTransferConfig.parse(
        '{"kv_connector": "ZmqConnector", "kv_connector_extra_config": {"pull_timeout_s": 0.3}}'
    )
    consumer = ZmqConnector(config)
    remote = RemoteParams("t", "e", "127.0.0.1", 1, (1,))
    try:
        with pytest.raises(TransferError, match="no answer"):
            asyncio.run(consumer.pull(remote))
    finally:
        consumer.close()


def test_pinned_blocks_never_wedge_a_full_pool(tiny_model_dir: Path) -> None:
    """A waiting request's pulled (pinned) blocks leave no room for the queue's head and
    nothing runs: the pins are dropped, both requests complete with the right tokens."""
    single = make_core(tiny_model_dir, "single")
    other = [t + 100 for t in PROMPT]
    want_x = run(single, Request("sx", list(PROMPT), GREEDY)).new_token_ids
    want_y = run(single, Request("sy", list(other), GREEDY)).new_token_ids
    prefill = make_core(tiny_model_dir, "prefill")
    assert prefill.kv_transfer is not None
    first = Request("p", list(PROMPT), SamplingParams(temperature=0.0, max_tokens=1))
    first.kv_transfer_params = {"do_remote_decode": True}
    params = run(prefill, first).kv_transfer_params
    assert params is not None
    payload = prefill.kv_transfer.read(params["remote_request_id"])

    runner = TorchModelRunner.from_model_dir(
        tiny_model_dir, block_size=BLOCK, num_blocks=14, device="cpu"
    )
    decode = EngineCore(
        runner, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=56)
    )
    decode.kv_transfer = KVTransfer(decode.kv, runner, engine_id="d", abort_timeout_s=60)
    y = Request("y", list(other), GREEDY)  # needs all 14 blocks; first in the queue
    x = Request("x", list(PROMPT), GREEDY)
    x.kv_payload = payload  # pins 10 of the 14 blocks while x waits behind y
    decode.add_request(y)
    decode.add_request(x)
    assert decode.kv_transfer.pins
    tokens: dict[str, list[int]] = {"x": [], "y": []}
    for _ in range(500):
        if not decode.has_work():
            break
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
    assert not decode.has_work(), "the engine wedged"
    assert tokens == {"x": want_x, "y": want_y}
    assert decode.kv.pool.num_free_blocks == 14
