"""The EPP's KV-event index learns adapter names from ``BlockStored`` (vLLM's
``lora_name``) and matches prompts hashed with the adapter, as the engine hashes them."""

from __future__ import annotations

import msgspec
from infergate.engine.kv_events import BlockStored, KVEventBatch
from infergate.epp.datalayer.kv_events import KVBlockIndex, apply_batch

from infergate.wire.block_hash import block_hashes

TOKENS = list(range(1, 65))


def test_adapter_blocks_are_indexed_under_adapter_hashes() -> None:
    hashes = block_hashes(TOKENS, 16, lora_name="sql")
    event = BlockStored(hashes, None, TOKENS, 16, lora_id=3, medium="GPU", lora_name="sql")
    payload = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[event]))
    index = KVBlockIndex()
    assert apply_batch(index, "pod-a", payload) == {"BlockStored": 1}
    assert index.adapters == {"sql"}
    assert index.leading_matches(hashes) == {"pod-a": 4}
    assert index.leading_matches(block_hashes(TOKENS, 16)) == {}  # the base model's KV
    assert index.leading_matches(block_hashes(TOKENS, 16, lora_name="chat")) == {}


async def test_precise_scorer_hashes_adapter_requests_with_the_adapter() -> None:
    from infergate.epp.types import CycleState

    from .test_plugins import make, req, state

    plugin = make("precise-prefix-cache-scorer", blockSize=16)
    a, b = state(1), state(2)
    stored = BlockStored(block_hashes(TOKENS, 16, lora_name="sql"), None, TOKENS, 16,
                         lora_id=1, medium="GPU", lora_name="sql")  # fmt: skip
    apply_batch(plugin.index, a.key, msgspec.msgpack.encode(KVEventBatch(0.0, [stored])))
    scores = {}
    for model in ("sql", "base"):
        cycle = CycleState()
        request = req(target_model=model, body={"model": model, "prompt": TOKENS})
        await plugin.prepare(cycle, request, [a, b])
        scores[model] = plugin.score(cycle, request, [a, b])
    # The adapter's request finds its blocks; the base model's same prompt does not
    # (the engine computed them with the adapter's weights).
    assert scores == {"sql": [1.0, 0.0], "base": [0.0, 0.0]}
    # An adapter known only from the engines' vllm:lora_requests_info is hashed alike.
    c = state(3, active_models=frozenset({"chat"}))
    cycle = CycleState()
    await plugin.prepare(cycle, req(target_model="chat", body={"prompt": TOKENS}), [c])
    assert cycle["precise.hashes"] == block_hashes(TOKENS, 16, lora_name="chat")
