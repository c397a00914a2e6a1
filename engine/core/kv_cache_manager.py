"""Per-request KV block tables on top of the block pool, with prefix caching.

The scheduler asks three things: how much of a new request's prompt is already cached
(:meth:`KVCacheManager.find_cached_prefix`), to reserve blocks for the tokens it is about to
compute (:meth:`allocate`), and, after a step, to commit the blocks that became full
(:meth:`commit_full_blocks`) so their contents — prompt or generated — become reusable.
"""

from __future__ import annotations

from dataclasses import dataclass

from infergate.engine.core.block_pool import Block, BlockPool
from infergate.engine.core.request import Request


@dataclass
class CachedPrefix:
    blocks: list[Block]

    def num_tokens(self, block_size: int) -> int:
        return len(self.blocks) * block_size


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        enable_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size, enable_events=enable_events)
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[Block]] = {}
        self._ids: dict[str, list[int]] = {}  # the same tables as block ids, kept in step
        self._num_committed: dict[str, int] = {}
        # Prefix-cache statistics, in tokens (vLLM's prefix_cache_queries / _hits).
        self.queries = 0
        self.hits = 0

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._ids.get(request_id, ()))

    def usage(self) -> float:
        return self.pool.usage()

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest run of cached blocks matching the request's leading full blocks.

        At least one token is always left to compute: the step that computes it is the one
        that produces the logits for the next token.
        """
        if not self.enable_prefix_caching or request.sampling.prompt_logprobs is not None:
            return CachedPrefix([])  # prompt logprobs need every prompt position computed
        request.update_block_hashes(self.block_size)
        limit = (request.num_tokens - 1) // self.block_size
        blocks: list[Block] = []
        for block_hash in request.block_hashes[:limit]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return CachedPrefix(blocks)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's prefix lookup (only admissions that went through)."""
        self.queries += num_tokens
        self.hits += num_hit_tokens

    def allocate(
        self, request: Request, num_new_tokens: int, cached: CachedPrefix | None = None
    ) -> bool:
        """Reserve blocks so ``num_new_tokens`` more tokens fit; False (nothing taken) if not.

        ``cached`` (only at admission) are prefix-hit blocks that join the table first; the
        request's ``num_computed_tokens`` must already count them.
        """
        table = self._tables.setdefault(request.request_id, [])
        ids = self._ids.setdefault(request.request_id, [])
        hit = cached.blocks if cached else []
        total_tokens = request.num_computed_tokens + num_new_tokens
        needed = -(-total_tokens // self.block_size) - len(table) - len(hit)
        # Hit blocks sitting in the free queue stop being free once we take them.
        reclaimed = sum(1 for b in hit if b.ref_cnt == 0)
        if needed + reclaimed > self.pool.num_free_blocks:
            if not table:
                del self._tables[request.request_id]
                del self._ids[request.request_id]
            return False
        if hit:
            self.pool.touch(hit)
            table.extend(hit)
            ids.extend(b.block_id for b in hit)
            self._num_committed[request.request_id] = len(table)
        if needed > 0:
            new = self.pool.take_new(needed)
            table.extend(new)
            ids.extend(b.block_id for b in new)
        return True

    def fork(self, child: Request, parent: Request) -> tuple[int, int] | None:
        """Give ``child`` (same prompt, nothing computed) ``parent``'s prompt KV.

        The parent has computed its whole prompt. Every block before the one holding the
        last prompt position is shared by reference (its ref count goes up); that last
        block is where the child writes first — it recomputes the last prompt token to
        get logits of its own, then appends its own tokens — so it gets a private copy
        (copy-on-write, done before anything writes). Returns the (source, destination)
        block ids the runner must copy, or None (nothing taken) when no block is free.
        ``child.num_computed_tokens`` is set to all but the last prompt token.
        """
        num_prompt = child.num_prompt_tokens
        assert parent.num_computed_tokens >= num_prompt and child.num_computed_tokens == 0
        parent_table = self._tables[parent.request_id]
        last = (num_prompt - 1) // self.block_size  # the block the child writes first
        if self.pool.num_free_blocks < 1:
            return None
        shared = parent_table[:last]
        self.pool.touch(shared)
        (own,) = self.pool.take_new(1)
        self._tables[child.request_id] = [*shared, own]
        self._ids[child.request_id] = [b.block_id for b in shared] + [own.block_id]
        # The parent committed every full prompt block when it computed them.
        self._num_committed[child.request_id] = last if self.enable_prefix_caching else 0
        child.num_computed_tokens = num_prompt - 1
        return parent_table[last].block_id, own.block_id

    def commit_full_blocks(self, request: Request) -> None:
        """Hash and publish every block whose tokens are now all computed."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            return
        done = self._num_committed.get(rid, 0)
        full = request.num_computed_tokens // self.block_size
        if full <= done:
            return
        request.update_block_hashes(self.block_size)
        bs = self.block_size
        self.pool.commit(
            table[done:full],
            request.block_hashes[done:full],
            request.block_hashes[done - 1] if done else None,
            request.all_token_ids[done * bs : full * bs],
            (request.lora.int_id, request.lora.name) if request.lora is not None else None,
        )
        self._num_committed[rid] = full

    def detach(self, request: Request) -> list[Block]:
        """Take the request's blocks away without freeing them (P/D: a finished prefill's
        KV held for a decode engine); the caller frees them later through the pool."""
        table = self._tables.pop(request.request_id, None) or []
        self._ids.pop(request.request_id, None)
        self._num_committed.pop(request.request_id, None)
        return table

    def free(self, request: Request) -> None:
        """Release the request's blocks; tail blocks go first in the eviction order."""
        table = self._tables.pop(request.request_id, None)
        self._ids.pop(request.request_id, None)
        self._num_committed.pop(request.request_id, None)
        if table:
            self.pool.free(reversed(table))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
