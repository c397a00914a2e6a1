"""Scheduler + KV cache manager: admission, chunking, prefix hits, preemption, eviction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from infergate.engine.core.kv_cache_manager import KVCacheManager
from infergate.engine.core.request import Request, RequestStatus
from infergate.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from infergate.engine.interfaces import SamplingParams
from infergate.engine.kv_events import BlockRemoved

BS = 16


def make(num_blocks: int = 64, budget: int = 2048, max_seqs: int = 256) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=4096),
        KVCacheManager(num_blocks, BS, enable_events=True),
    )


def req(rid: str, prompt: list[int], max_tokens: int = 4, salt: str | None = None) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), cache_salt=salt)


def step(s: Scheduler) -> SchedulerOutput:
    """Schedule, 'compute' (next token = position mod 1000 + 1000), update, finish."""
    out = s.schedule()
    sampled = [
        1000 + (seq.start_pos + len(seq.token_ids)) % 1000 if seq.sample else None
        for seq in out.batch.seqs
    ]
    for request in s.update_after_step(out, sampled):
        if request.check_stop():
            s.finish(request, request.status)
    return out


def drain(s: Scheduler, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not s.has_work():
            return
        step(s)
    raise AssertionError("scheduler did not drain")


def all_free(s: Scheduler) -> bool:
    return s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_prefill_then_decode_and_everything_freed() -> None:
    s = make()
    r = req("a", list(range(40)), max_tokens=3)
    s.add(r)
    first = step(s)
    (seq,) = first.batch.seqs
    assert (seq.start_pos, len(seq.token_ids), seq.sample) == (0, 40, True)
    assert len(seq.block_table) == 3
    second = step(s)
    assert [len(x.token_ids) for x in second.batch.seqs] == [1]
    drain(s)
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 3
    assert all_free(s)


def test_chunked_prefill_respects_the_budget_and_shares_batch_with_decodes() -> None:
    s = make(budget=16)
    a = req("a", list(range(10)), max_tokens=10)
    s.add(a)
    step(s)  # a prefilled (10 tokens) and sampled
    b = req("b", list(range(100, 140)))
    s.add(b)
    sizes = []
    for _ in range(3):
        out = step(s)
        sizes.append({seq.request_id: (len(seq.token_ids), seq.sample) for seq in out.batch.seqs})
        assert out.batch.num_tokens <= 16
    # a decodes one token each step; b's 40-token prompt comes in chunks of 15, 15, 10.
    assert sizes == [
        {"a": (1, True), "b": (15, False)},
        {"a": (1, True), "b": (15, False)},
        {"a": (1, True), "b": (10, True)},
    ]
    drain(s)
    assert all_free(s)


def test_max_num_seqs_caps_the_running_batch() -> None:
    s = make(max_seqs=2)
    for i in range(3):
        s.add(req(str(i), list(range(i * 50, i * 50 + 5))))
    out = step(s)
    assert [seq.request_id for seq in out.batch.seqs] == ["0", "1"]
    assert s.num_waiting == 1
    drain(s)
    assert all_free(s)


def test_prefix_hit_at_admission_skips_cached_blocks() -> None:
    s = make()
    shared = list(range(32))
    s.add(req("a", [*shared, 7, 8, 9]))
    drain(s)
    b = req("b", [*shared, 70, 80])
    s.add(b)
    out = step(s)
    (seq,) = out.batch.seqs
    assert (seq.start_pos, seq.token_ids) == (32, [70, 80])
    assert b.num_cached_tokens == 32
    assert s.kv.hits == 32 and s.kv.queries == 35 + 34
    drain(s)
    assert all_free(s)


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    s = make()
    prompt = list(range(32))
    s.add(req("a", prompt))
    drain(s)
    s.add(req("b", prompt))
    (seq,) = step(s).batch.seqs
    assert seq.start_pos == 16 and len(seq.token_ids) == 16 and seq.sample


def test_generated_tokens_become_cacheable() -> None:
    s = make()
    a = req("a", list(range(10)), max_tokens=10)
    s.add(a)
    drain(s)
    # a's first block = 10 prompt tokens + 6 generated ones; all 16 computed → committed.
    follow_up = req("b", [*a.all_token_ids[:16], 5, 5])
    s.add(follow_up)
    step(s)
    assert follow_up.num_cached_tokens == 16


def test_cache_salt_isolates_tenants() -> None:
    s = make()
    prompt = list(range(40))
    s.add(req("a", prompt, salt="alice"))
    drain(s)
    other = req("b", prompt, salt="bob")
    unsalted = req("c", prompt)
    same = req("d", prompt, salt="alice")
    for r in (other, unsalted, same):
        s.add(r)
        drain(s)
    assert (other.num_cached_tokens, unsalted.num_cached_tokens) == (0, 0)
    assert same.num_cached_tokens == 32


def test_prefix_caching_can_be_switched_off() -> None:
    s = Scheduler(SchedulerConfig(), KVCacheManager(64, BS, enable_prefix_caching=False))
    prompt = list(range(40))
    for rid in ("a", "b"):
        r = req(rid, prompt)
        s.add(r)
        drain(s)
        assert r.num_cached_tokens == 0
    assert s.kv.pool.num_cached_blocks() == 0 and all_free(s)


def test_lru_eviction_keeps_hashes_until_blocks_are_reused() -> None:
    s = make(num_blocks=4)
    s.add(req("a", list(range(32)), max_tokens=1))
    drain(s)
    assert s.kv.pool.num_cached_blocks() == 2 and all_free(s)
    # A different 64-token prompt needs all 4 blocks → both cached ones are evicted.
    s.add(req("b", list(range(100, 164)), max_tokens=1))
    step(s)
    removed = [e for e in s.kv.pool.drain_events() if isinstance(e, BlockRemoved)]
    assert sum(len(e.block_hashes) for e in removed) == 2
    again = req("c", list(range(32)), max_tokens=1)
    drain(s)
    s.add(again)
    drain(s)
    assert again.num_cached_tokens == 0


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    s = make(num_blocks=6)
    a = req("a", list(range(30)), max_tokens=40)  # grows to 70 tokens = 5 blocks
    b = req("b", list(range(100, 130)), max_tokens=40)
    s.add(a)
    s.add(b)
    preempted: list[str] = []
    for _ in range(500):
        if not s.has_work():
            break
        out = step(s)
        preempted += [r.request_id for r in out.preempted]
    assert preempted and preempted[0] == "b"  # the later request yields first
    assert s.num_preemptions >= 1 and b.num_preemptions >= 1
    assert a.num_output_tokens == b.num_output_tokens == 40
    # Recompute regenerates the same tokens (deterministic "model") after preemption.
    assert b.output_token_ids == [1000 + (30 + i) % 1000 for i in range(40)]
    assert all_free(s)


def test_prefix_stats_count_admissions_not_retries() -> None:
    s = make(num_blocks=4)
    s.add(req("a", list(range(40)), max_tokens=20))  # 60 tokens: 4 blocks at the end
    step(s)
    b = req("b", list(range(100, 140)))  # needs 3 blocks, 1 is free: waits for a to end
    s.add(b)
    for _ in range(10):
        step(s)
        assert b.status is RequestStatus.WAITING
    drain(s)
    assert s.kv.queries == 40 + 40  # one lookup per admission, however long b waited
    assert all_free(s)


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    s = make(max_seqs=1)
    a, b = req("a", list(range(40)), 100), req("b", list(range(50, 90)), 100)
    s.add(a)
    s.add(b)
    step(s)
    s.abort("a")
    s.abort("b")
    assert a.status is b.status is RequestStatus.FINISHED_ABORTED
    assert not s.has_work() and all_free(s)


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=70), min_size=1, max_size=6),
    budget=st.integers(1, 64),
    num_blocks=st.integers(5, 24),
    max_tokens=st.integers(1, 20),
    abort_at=st.integers(0, 30),
)
def test_random_workloads_finish_and_free_every_block(
    prompts: list[list[int]], budget: int, num_blocks: int, max_tokens: int, abort_at: int
) -> None:
    s = make(num_blocks=num_blocks, budget=budget)
    requests = [req(str(i), p, max_tokens=max_tokens) for i, p in enumerate(prompts)]
    for r in requests:
        s.add(r)
    for n in range(5000):
        if not s.has_work():
            break
        if n == abort_at:
            s.abort("0")
        out = step(s)
        assert out.batch.num_tokens <= budget
        used = sum(1 for b in s.kv.pool.blocks if b.ref_cnt > 0)
        assert used == s.kv.pool.num_blocks - s.kv.pool.num_free_blocks
    assert not s.has_work()
    assert all_free(s)
    for r in requests[1:]:
        assert r.num_output_tokens == max_tokens


def test_pending_prefill_counts_running_prompts_until_their_step_ends() -> None:
    """What a load report tells other EPP replicas: running prompt tokens not computed
    yet. A prefill in progress counts until its step's update; a prefix hit counts only
    its uncached part; a waiting request is not counted (its hit is unknown yet)."""
    s = make(budget=64)
    s.add(req("a", list(range(100))))
    assert s.pending_prefill_tokens == 0  # waiting: in waiting_prefill_tokens, not here
    out = s.schedule()  # admitted; its first 64-token chunk runs now
    assert s.pending_prefill_tokens == 100
    s.update_after_step(out, [None])
    assert s.pending_prefill_tokens == 36
    step(s)  # the last chunk
    assert s.pending_prefill_tokens == 0
    drain(s)
    s.add(req("b", [*range(100), 7, 7]))  # the same 96 cached tokens + 6 new ones
    s.schedule()
    assert s.pending_prefill_tokens == 102 - 96


def test_waiting_prefill_counts_what_was_uncached_at_arrival_until_admission() -> None:
    """The prefill queued behind the running requests, for load reports: each waiting
    request's prompt less the prefix cached when it arrived; admission takes it out."""
    s = make(budget=64, max_seqs=1)
    s.add(req("warm", list(range(100))))
    drain(s)  # 96 tokens (6 full blocks) of it stay cached
    s.add(req("running", list(range(500, 540)), max_tokens=8))
    step(s)  # admitted; max_seqs=1 keeps the next ones waiting
    s.add(req("hit", [*range(100), 7, 7]))  # 96 cached + 6 new
    s.add(req("cold", list(range(2000, 2050))))
    assert s.num_waiting == 2
    assert s.waiting_prefill_tokens == (102 - 96) + 50
    drain(s)
    assert s.waiting_prefill_tokens == 0 and s.num_waiting == 0
