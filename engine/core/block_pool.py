"""A fixed pool of KV blocks with a prefix-cache index and lazy LRU eviction.

A block whose last user lets go goes to the tail of the free queue *with its hash*, so a
later request with the same prefix can take it back (a prefix-cache hit). Only when the
pool hands the block out for new tokens is its hash dropped (an eviction, reported as a
``BlockRemoved`` event). The free queue's head is therefore the least recently used block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from infergate.engine.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set once the block is full and committed


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, enable_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block_id -> Block for every block with ref_cnt 0, least recently used first.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, Block] = {}  # block hash -> the block holding it
        self.enable_events = enable_events
        self._events: list[KVEvent] = []

    # -- queries -----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks in use by live requests (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: int) -> Block | None:
        return self._cached.get(block_hash)

    def num_cached_blocks(self) -> int:
        return len(self._cached)

    # -- allocation --------------------------------------------------------------
    def take_new(self, n: int) -> list[Block]:
        """Hand out ``n`` free blocks, evicting the cached contents of the oldest ones."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, {len(self._free)} free")
        out: list[Block] = []
        evicted: list[int] = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        if evicted and self.enable_events:
            self._events.append(BlockRemoved(block_hashes=evicted, medium=MEDIUM_GPU))
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones out of LRU."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop a reference; pass blocks in the order they should be evicted (tail first)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def commit(
        self,
        blocks: list[Block],
        hashes: list[int],
        parent_hash: int | None,
        token_ids: list[int],
        lora: tuple[int, str] | None = None,
    ) -> None:
        """Register full blocks under their hashes so later requests can reuse them.

        ``lora`` is the (id, name) of the adapter the blocks were computed with, which
        the ``BlockStored`` event carries as vLLM's does.

        A hash already held by another block (two requests computed the same prefix at
        once) is left unregistered on this copy; the copy is simply freed later.
        """
        stored: list[int] = []
        for block, block_hash in zip(blocks, hashes, strict=True):
            if block_hash in self._cached:
                continue
            block.block_hash = block_hash
            self._cached[block_hash] = block
            stored.append(block_hash)
        if stored and self.enable_events:
            # One event per committed run, as vLLM does: parent + concatenated tokens.
            self._events.append(
                BlockStored(
                    block_hashes=list(hashes),
                    parent_block_hash=parent_hash,
                    token_ids=token_ids,
                    block_size=self.block_size,
                    lora_id=lora[0] if lora else None,
                    medium=MEDIUM_GPU,
                    lora_name=lora[1] if lora else None,
                )
            )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
