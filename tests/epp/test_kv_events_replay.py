"""A gap in a real engine's KV events is filled from its replay socket, or dropped honestly.

The engine is a real ``engine serve --simulate`` process with a small KV cache, so a few
prompts evict each other's blocks. Between it and the EPP sits :class:`LossyRelay`, a
test-only ZMQ forwarder that drops the engine's batches while told to: the EPP sees the
jump in ``seq`` a lost PUB/SUB message causes, and must ask the engine's replay socket
(which it reaches directly) for what it missed. The relay applies every batch the engine
published to its own index, so "the EPP's index equals the engine's blocks" is checked
against the engine's complete event history, lost batches included.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio
from infergate.epp.config import parse_config
from infergate.epp.datalayer.kv_events import (
    KV_EVENTS_PORT_LABEL,
    KV_EVENTS_REPLAY_PORT_LABEL,
    KVBlockIndex,
    apply_batch,
)
from infergate.epp.types import Endpoint

from infergate.procs import ProcessGroup, free_port, http_ready
from infergate.wire.block_hash import block_hashes
from infergate.wire.kv_events import decode_seq

from .conftest import eventually
from .test_precise_prefix import CONFIG  # the precise scorer (its blockSize: hashing only)

BLOCK = 16
#: Ten full blocks per prompt against a 32-block cache: the fourth prompt evicts the first.
PROMPT_TOKENS = 10 * BLOCK


class LossyRelay:
    """Test-only forwarder of an engine's KV events that loses them while ``dropping``."""

    def __init__(self, context: zmq.asyncio.Context, source_port: int, key: str) -> None:
        self.key = key
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://127.0.0.1:{source_port}")
        self.port = free_port()
        self.pub = context.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.dropping = False
        self.reference = KVBlockIndex()  # every batch the engine published
        self.seqs: list[int] = []
        self.dropped: list[int] = []
        self.removed_while_dropping: set[int] = set()
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            frames = await self.sub.recv_multipart()
            seq = decode_seq(frames[1])
            self.seqs.append(seq)
            held = set(self.reference.by_endpoint.get(self.key, ()))
            apply_batch(self.reference, self.key, frames[2])
            if self.dropping:
                self.dropped.append(seq)
                self.removed_while_dropping |= held - self.blocks()
            else:
                await self.pub.send_multipart(frames)

    def blocks(self) -> set[int]:
        return set(self.reference.by_endpoint.get(self.key, ()))

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.sub.close(0)
        self.pub.close(0)


def prompt(i: int) -> list[int]:
    """Prompt ``i``'s token ids: its own first token, so no block hash is shared across
    prompts (each hash covers its parent); all within the tiny model's vocabulary."""
    return [10 + i] + [20 + (7 * i + t) % 400 for t in range(PROMPT_TOKENS - 1)]


async def complete(port: int, tokens: list[int]) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        response = await client.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny", "prompt": tokens, "max_tokens": 2},
        )
    assert response.status_code == 200, response.text


def start_engine(
    processes: ProcessGroup,
    cli: list[str],
    model: Path,
    *extra: str,
    ports: tuple[int, int, int] | None = None,
) -> tuple[int, int, int]:
    """A simulated engine with 32 KV blocks; (HTTP, KV events, replay) ports, free ones
    unless given (a restart on the same address)."""
    port, kv_port, replay_port = ports or (free_port(), free_port(), free_port())
    processes.start(
        f"engine-replay-{port}-{len(list(processes))}",
        [
            *cli, "engine", "serve", str(model), "--port", str(port),
            "--served-model-name", "tiny", "--simulate", "--block-size", str(BLOCK),
            "--num-gpu-blocks-override", "32", "--max-model-len", "512",
            "--kv-events-port", str(kv_port), "--kv-events-replay-port", str(replay_port),
            *extra,
        ],
        ready=http_ready(f"http://127.0.0.1:{port}/health"),
        timeout=120,
    )  # fmt: skip
    return port, kv_port, replay_port


def gaps(epp, result: str) -> float:
    value = epp.metrics.registry.get_sample_value(
        "infergate_epp_kv_events_gaps_total", {"result": result}
    )
    return value or 0.0


async def run_with_a_gap(
    epp_factory, relay: LossyRelay, port: int, labels: tuple[tuple[str, str], ...]
) -> tuple[Any, Any]:
    """Prompt 0 reaches the EPP; prompts 1-3 are lost (and evict prompt 0's blocks);
    prompt 4 arrives after the gap. Returns (epp, plugin) once prompt 4 is in the relay."""
    host, _, engine_port = relay.key.rpartition(":")
    engine = Endpoint(host, int(engine_port), labels)
    epp = await epp_factory(static_endpoints=[engine], config=parse_config(CONFIG))
    plugin = epp.scheduler.plugins["precise-prefix-cache-scorer"]
    index = plugin.index
    await asyncio.sleep(0.3)  # the EPP's SUB joins the relay

    await complete(port, prompt(0))
    await eventually(lambda: set(block_hashes(prompt(0), BLOCK)) <= relay.blocks(), timeout=30)
    await eventually(lambda: index.by_endpoint.get(relay.key) == relay.blocks(), timeout=30)
    assert relay.seqs == list(range(len(relay.seqs))), "the relay missed the engine's start"

    relay.dropping = True
    for i in (1, 2, 3):
        await complete(port, prompt(i))
    await eventually(lambda: set(block_hashes(prompt(3), BLOCK)) <= relay.blocks(), timeout=30)
    assert relay.dropped and relay.removed_while_dropping, "the lost batches held no eviction"
    # The EPP still believes prompt 0's evicted blocks are there: it has seen nothing.
    assert relay.removed_while_dropping <= index.by_endpoint[relay.key]

    relay.dropping = False
    await complete(port, prompt(4))
    await eventually(lambda: set(block_hashes(prompt(4), BLOCK)) <= relay.blocks(), timeout=30)
    return epp, plugin


async def test_a_gap_is_filled_from_the_engines_replay_socket(
    processes, infergate_cli, tiny_model, epp_factory
) -> None:
    port, kv_port, replay_port = start_engine(processes, infergate_cli, tiny_model)
    context = zmq.asyncio.Context()
    relay = LossyRelay(context, kv_port, f"127.0.0.1:{port}")
    try:
        await asyncio.sleep(0.3)  # the relay's SUB joins before the engine publishes
        labels = ((KV_EVENTS_PORT_LABEL, str(relay.port)),
                  (KV_EVENTS_REPLAY_PORT_LABEL, str(replay_port)))  # fmt: skip
        epp, plugin = await run_with_a_gap(epp_factory, relay, port, labels)

        await eventually(lambda: gaps(epp, "filled") == 1, timeout=30)
        await eventually(lambda: plugin.index.by_endpoint.get(relay.key) == relay.blocks())
        assert gaps(epp, "dropped") == 0
        assert not relay.removed_while_dropping & plugin.index.by_endpoint[relay.key]
        replayed = epp.metrics.registry.get_sample_value(
            "infergate_epp_kv_events_replayed_batches_total"
        )
        assert replayed is not None and replayed >= len(relay.dropped)
    finally:
        await relay.close()
        context.term()


@pytest.mark.parametrize("why", ["range no longer buffered", "no replay socket known"])
async def test_an_unfillable_gap_drops_the_endpoints_entries(
    processes, infergate_cli, tiny_model, epp_factory, why: str
) -> None:
    """The fallback: the entries that may be stale go, and are counted as a dropped gap;
    what the engine stores after the gap rebuilds the index, never beyond the truth."""
    extra = ["--kv-events-config", '{"buffer_steps": 2}'] if "buffered" in why else []
    port, kv_port, replay_port = start_engine(processes, infergate_cli, tiny_model, *extra)
    context = zmq.asyncio.Context()
    relay = LossyRelay(context, kv_port, f"127.0.0.1:{port}")
    try:
        await asyncio.sleep(0.3)
        labels: tuple[tuple[str, str], ...] = ((KV_EVENTS_PORT_LABEL, str(relay.port)),)
        if "buffered" in why:
            labels += ((KV_EVENTS_REPLAY_PORT_LABEL, str(replay_port)),)
        epp, plugin = await run_with_a_gap(epp_factory, relay, port, labels)

        await eventually(lambda: gaps(epp, "dropped") == 1, timeout=30)
        ours = set(block_hashes(prompt(4), BLOCK))

        def rebuilt_within_the_truth() -> bool:
            # Prompt 4's decode step may evict (one more batch): wait for the EPP to apply
            # all the relay forwarded, not only prompt 4's BlockStored.
            held = plugin.index.by_endpoint.get(relay.key, set())
            return ours <= held <= relay.blocks()  # nothing the engine does not hold

        await eventually(rebuilt_within_the_truth)
        assert gaps(epp, "filled") == 0
        assert not relay.removed_while_dropping & plugin.index.by_endpoint[relay.key]
        if "buffered" in why:
            assert len(relay.dropped) > 2, "the gap fitted in the replay buffer"
    finally:
        await relay.close()
        context.term()


async def test_a_late_epp_learns_the_engines_blocks_and_an_engine_restart_replaces_them(
    processes, infergate_cli, tiny_model, epp_factory
) -> None:
    """An EPP (re)started after the engine has stored blocks learns them from the replay
    socket at once, with no new traffic; an engine restarted on the same address numbers
    its batches from 0 again, and the EPP then drops the old engine's blocks."""
    port, kv_port, replay_port = start_engine(processes, infergate_cli, tiny_model)
    await complete(port, prompt(0))
    await complete(port, prompt(1))
    engine = Endpoint("127.0.0.1", port, ((KV_EVENTS_PORT_LABEL, str(kv_port)),
                                          (KV_EVENTS_REPLAY_PORT_LABEL, str(replay_port))))  # fmt: skip
    epp = await epp_factory(static_endpoints=[engine], config=parse_config(CONFIG))
    index = epp.scheduler.plugins["precise-prefix-cache-scorer"].index
    both = set(block_hashes(prompt(0), BLOCK)) | set(block_hashes(prompt(1), BLOCK))
    await eventually(lambda: index.by_endpoint.get(engine.key) == both, timeout=30)

    for process in processes:
        process.stop()
    start_engine(processes, infergate_cli, tiny_model, ports=(port, kv_port, replay_port))
    await asyncio.sleep(0.5)  # the EPP's SUB reconnects (every 100 ms) before the engine publishes
    await complete(port, prompt(2))
    fresh = set(block_hashes(prompt(2), BLOCK))
    await eventually(lambda: index.by_endpoint.get(engine.key) == fresh, timeout=30)
    assert gaps(epp, "filled") == gaps(epp, "dropped") == 0
