"""KV-cache events and their replay, in vLLM's wire format (``vllm/distributed/kv_events.py``).

Why here: the engine publishes these and the EPP's precise-prefix index consumes them, so
both import this module and nothing of each other.

**Live stream** (ZMQ PUB → SUB). Each message is multipart ``[topic, seq, payload]``:
``topic`` (default empty), ``seq`` the batch's sequence number as 8 bytes big-endian
(from 0, one per batch, per publisher), ``payload`` a msgpack :class:`KVEventBatch`, the
array ``[ts, events, data_parallel_rank]``. Each event is a tagged array whose first
element is its class name: ``["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]``,
``["AllBlocksCleared"]``. Block hashes are unsigned 64-bit ints
(:mod:`infergate.wire.block_hash`); ``medium`` is ``"GPU"`` (the engine's own KV memory).

**Replay** (ZMQ ROUTER on the publisher's replay endpoint). PUB/SUB drops what a
subscriber misses (a reconnect, a full high-water mark), and the subscriber sees it as a
jump in ``seq``. It then asks the replay socket for the batches it missed:

* request: one frame, the first wanted ``seq`` (8 bytes big-endian), sent from a REQ
  socket or from a DEALER after an empty delimiter frame — the ROUTER sees
  ``[identity, b"", seq]``;
* reply: one message ``[seq, payload]`` per buffered batch whose ``seq`` is at least the
  one asked for, oldest first, each exactly as it was published; then the end marker
  ``[END_OF_REPLAY, b""]`` (``-1`` as a signed 8-byte integer, empty payload). A DEALER
  receives each with the empty delimiter in front.

The publisher keeps only its last ``buffer_steps`` batches, so a reply may start later
than asked (the range is gone) or hold nothing but the end marker; the subscriber tells a
filled gap from a lost one by the first ``seq`` it gets back.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
#: Bytes of a sequence number on the wire.
SEQ_SIZE = 8
#: The ``seq`` frame of the message that ends a replay (its payload is empty).
END_OF_REPLAY = (-1).to_bytes(SEQ_SIZE, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    """A batch's sequence number as its frame (8 bytes big-endian, unsigned)."""
    return seq.to_bytes(SEQ_SIZE, "big")


def decode_seq(frame: bytes) -> int:
    """The sequence number in ``frame``; ValueError unless it is exactly 8 bytes."""
    if len(frame) != SEQ_SIZE:
        raise ValueError(f"a sequence number is {SEQ_SIZE} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event structs (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    # No defaults, so omit_defaults never drops them: consumers index these positions.
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload strictly (tests and tools; the EPP decodes generically)."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)
