"""Block pool invariants, checked by hypothesis over random operation sequences."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from infergate.engine.core.block_pool import Block, BlockPool
from infergate.engine.kv_events import BlockRemoved, BlockStored


class PoolMachine(RuleBasedStateMachine):
    """Owners take, share, commit and free blocks; the pool must keep its books."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(8, 4, enable_events=True)
        self.owners: list[list[Block]] = []
        self.next_hash = 1
        self.live_hashes: set[int] = set()

    @rule(n=st.integers(1, 4))
    def take(self, n: int) -> None:
        if n <= self.pool.num_free_blocks:
            self.owners.append(self.pool.take_new(n))

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(self.owners))
        fresh = [b for b in owner if b.block_hash is None]
        hashes = list(range(self.next_hash, self.next_hash + len(fresh)))
        self.next_hash += len(fresh)
        self.pool.commit(fresh, hashes, None, [0] * 4 * len(fresh))

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def share_cached(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(self.owners))
        cached = [b for b in owner if b.block_hash is not None]
        if cached:
            self.pool.touch(cached)
            self.owners.append(cached)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        owner = self.owners.pop(data.draw(st.integers(0, len(self.owners) - 1)))
        self.pool.free(reversed(owner))

    @rule()
    def revive_free_cached(self) -> None:
        """A prefix hit on a freed-but-cached block takes it back out of the LRU queue."""
        for block in self.pool.blocks:
            if block.ref_cnt == 0 and block.block_hash is not None:
                assert self.pool.lookup(block.block_hash) is block
                self.pool.touch([block])
                self.owners.append([block])
                return

    @invariant()
    def books_balance(self) -> None:
        refs: dict[int, int] = {}
        for owner in self.owners:
            for block in owner:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0)
        free = sum(1 for b in self.pool.blocks if b.ref_cnt == 0)
        assert self.pool.num_free_blocks == free
        assert 0.0 <= self.pool.usage() <= 1.0

    @invariant()
    def index_matches_blocks(self) -> None:
        hashed = {b.block_hash: b for b in self.pool.blocks if b.block_hash is not None}
        assert self.pool.num_cached_blocks() == len(hashed)
        for block_hash, block in hashed.items():
            assert self.pool.lookup(block_hash) is block

    @invariant()
    def events_replay_to_the_index(self) -> None:
        for event in self.pool.drain_events():
            if isinstance(event, BlockStored):
                self.live_hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.live_hashes
                self.live_hashes.difference_update(event.block_hashes)
        indexed = {b.block_hash for b in self.pool.blocks if b.block_hash is not None}
        assert self.live_hashes == indexed

    def teardown(self) -> None:
        for owner in self.owners:
            self.pool.free(owner)
        assert self.pool.num_free_blocks == self.pool.num_blocks


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestBlockPool = PoolMachine.TestCase


def test_lru_evicts_least_recently_freed_first() -> None:
    pool = BlockPool(3, 2, enable_events=True)
    a, b, c = pool.take_new(3)
    pool.commit([a, b, c], [11, 12, 13], None, [0] * 6)
    pool.free([b])
    pool.free([a])
    pool.free([c])
    pool.drain_events()
    (first,) = pool.take_new(1)
    assert first is b and pool.lookup(12) is None and pool.lookup(11) is a
    assert pool.drain_events() == [BlockRemoved(block_hashes=[12], medium="GPU")]


def test_reset_prefix_cache_refused_while_in_use() -> None:
    pool = BlockPool(2, 2, enable_events=True)
    (block,) = pool.take_new(1)
    pool.commit([block], [5], None, [1, 2])
    assert not pool.reset_prefix_cache()
    pool.free([block])
    assert pool.reset_prefix_cache()
    assert pool.lookup(5) is None
    assert type(pool.drain_events()[-1]).__name__ == "AllBlocksCleared"
