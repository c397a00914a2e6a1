"""The EPP's KV-event index learns adapter names from ``BlockStored`` (vLLM's
``lora_name``) and matches prompts hashed with the adapter, as the engine hashes them."""

from __future__ import annotations

import msgspec
from infergate.engine.block_hash import block_hashes
from infergate.engine.kv_events import BlockStored, KVEventBatch
from infergate.epp.datalayer.kv_events import KVBlockIndex, apply_batch

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
