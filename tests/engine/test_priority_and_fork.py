"""Scheduler policies (fcfs, priority) and n > 1 forked block tables, on the real
scheduler and KV cache manager with a deterministic stand-in for the model."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from infergate.engine.core.kv_cache_manager import KVCacheManager
from infergate.engine.core.request import Request
from infergate.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from infergate.engine.core.waiting_queue import WaitingQueue
from infergate.engine.interfaces import SamplingParams

BS = 16


def make(policy: str = "fcfs", num_blocks: int = 64, max_seqs: int = 256) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=2048, policy=policy)  # type: ignore[arg-type]
    return Scheduler(config, KVCacheManager(num_blocks, BS))


def req(rid: str, prompt: list[int], max_tokens: int = 4, priority: int = 0,
        arrival: float | None = None) -> Request:  # fmt: skip
    r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), priority=priority)
    if arrival is not None:
        r.arrival_time = arrival
    return r


def step(s: Scheduler) -> SchedulerOutput:
    """Schedule, 'compute' (next token = position mod 1000 + 1000), update, finish."""
    out = s.schedule()
    sampled = [
        1000 + (q.start_pos + len(q.token_ids)) % 1000 if q.sample else None for q in out.batch.seqs
    ]
    for request in s.update_after_step(out, sampled):
        if request.check_stop():
            s.finish(request, request.status)
    return out


def drain(s: Scheduler, max_steps: int = 5000) -> None:
    for _ in range(max_steps):
        if not s.has_work():
            return
        step(s)
    raise AssertionError("scheduler did not drain")


def all_free(s: Scheduler) -> bool:
    return s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def admitted(s: Scheduler) -> list[str]:
    return [r.request_id for r in step(s).requests]


# -- priority --------------------------------------------------------------------------
def test_priority_policy_admits_the_lowest_value_first_then_by_arrival() -> None:
    s = make("priority", max_seqs=1)
    s.add(req("running", [1, 2, 3], max_tokens=2))
    assert admitted(s) == ["running"]  # fills the only slot
    for i in range(4):
        s.add(req(f"low-{i}", [10 + i] * 5, priority=5))
    s.add(req("high", [99] * 5, priority=-3))  # arrives last, runs first
    s.add(req("mid", [98] * 5, priority=0))
    order: list[str] = []
    while s.has_work():
        for rid in admitted(s):
            if rid not in order:
                order.append(rid)
    assert order == ["running", "high", "mid", "low-0", "low-1", "low-2", "low-3"]
    assert all_free(s)


def test_fcfs_ignores_priority() -> None:
    s = make("fcfs", max_seqs=1)
    s.add(req("a", [1] * 5, priority=9))
    s.add(req("b", [2] * 5, priority=-9))
    order: list[str] = []
    while s.has_work():
        order += [r for r in admitted(s) if r not in order]
    assert order == ["a", "b"]


def test_priority_preemption_takes_the_least_important_latest_request() -> None:
    # 6 blocks; three requests of 2 blocks each fill them, then growth forces preemption.
    s = make("priority", num_blocks=6)
    s.add(req("important", list(range(30)), max_tokens=40, priority=-1, arrival=3.0))
    s.add(req("old-bulk", list(range(100, 130)), max_tokens=40, priority=1, arrival=1.0))
    s.add(req("new-bulk", list(range(200, 230)), max_tokens=40, priority=1, arrival=2.0))
    victims: list[str] = []
    while s.has_work():
        victims += [r.request_id for r in step(s).preempted]
    assert victims[:2] == ["new-bulk", "old-bulk"]  # same priority: the latest first
    assert s.requests == {} and all_free(s)
    # fcfs on the same load preempts the last admitted, whatever the priorities.
    f = make("fcfs", num_blocks=6)
    f.add(req("a", list(range(30)), max_tokens=40, priority=5))
    f.add(req("b", list(range(100, 130)), max_tokens=40, priority=-5))
    first = next(o.preempted for o in iter(lambda: step(f), None) if o.preempted)
    assert [r.request_id for r in first] == ["b"]


def test_priority_victim_already_scheduled_this_step_is_taken_back_out() -> None:
    """The victim can sit before the request that needs the block (it was admitted
    first): its tokens leave the batch and the budget it had comes back."""
    s = make("priority", num_blocks=5)
    low = req("low", list(range(16)), max_tokens=40, priority=7)
    s.add(low)
    assert admitted(s) == ["low"]
    high = req("high", list(range(100, 117)), max_tokens=40, priority=0)
    s.add(high)  # admitted behind low; both reach their third block in the same step
    outs = [step(s) for _ in range(17)]
    assert all(not o.preempted for o in outs[:-1])
    assert [r.request_id for r in outs[-2].requests] == ["low", "high"]
    # low (first in the batch) took the last free block; high then needed one, and
    # low, the less important, gave its blocks back and left this step's batch.
    assert [r.request_id for r in outs[-1].preempted] == ["low"]
    assert [r.request_id for r in outs[-1].requests] == ["high"]
    drain(s)
    assert low.num_output_tokens == high.num_output_tokens == 40
    assert all_free(s)


def test_waiting_queue_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError, match="scheduling policy"):
        WaitingQueue("lifo")  # type: ignore[arg-type]


# -- n > 1: forked block tables --------------------------------------------------------
def group(n: int, prompt: list[int], max_tokens: int) -> list[Request]:
    reqs = [req(f"s{j}", prompt, max_tokens=max_tokens) for j in range(n)]
    for sibling in reqs[1:]:
        sibling.fork_parent = reqs[0]
    return reqs


def peak_blocks(s: Scheduler) -> int:
    peak = 0
    while s.has_work():
        step(s)
        peak = max(peak, s.kv.pool.num_blocks - s.kv.pool.num_free_blocks)
    return peak


def test_siblings_share_the_prompt_blocks_and_compute_one_token_each() -> None:
    prompt = list(range(100))  # 7 blocks: 6 full + 4 tokens
    s = make(num_blocks=64)
    reqs = group(4, prompt, max_tokens=20)
    for r in reqs:
        s.add(r)
    first = step(s)
    assert [r.request_id for r in first.requests] == ["s0"]  # siblings wait for the prefill
    second = step(s)
    by_id = {q.request_id: q for q in second.batch.seqs}
    assert set(by_id) == {"s0", "s1", "s2", "s3"}
    for j in (1, 2, 3):
        seq = by_id[f"s{j}"]
        assert (seq.start_pos, seq.token_ids) == (99, [99])  # only the last prompt token
        assert seq.block_table[:6] == by_id["s0"].block_table[:6]  # shared by reference
        assert seq.block_table[6] != by_id["s0"].block_table[6]  # its own copy
    parent_last = by_id["s0"].block_table[6]
    assert sorted(second.batch.block_copies) == sorted(
        (parent_last, by_id[f"s{j}"].block_table[6]) for j in (1, 2, 3)
    )
    assert s.kv.pool.blocks[by_id["s0"].block_table[0]].ref_cnt == 4
    drain(s)
    assert all_free(s)
    # Every sibling produced the tokens the stand-in model gives after that prompt.
    assert all(r.output_token_ids == reqs[0].output_token_ids for r in reqs)


def test_kv_blocks_for_n4_are_prompt_plus_outputs_not_four_prompts() -> None:
    prompt, out = list(range(100)), 20  # 120 tokens: 8 blocks per sequence
    forked = make(num_blocks=64)
    for r in group(4, prompt, out):
        forked.add(r)
    independent = make(num_blocks=64, max_seqs=256)
    for j in range(4):
        independent.add(req(f"i{j}", prompt, max_tokens=out))
    # 6 shared prompt blocks + 4 x (last prompt block + output block) = 14, against 4 x 8.
    assert peak_blocks(forked) == 6 + 4 * 2
    assert peak_blocks(independent) == 4 * 8


def test_sibling_falls_back_to_its_own_prefill_when_the_parent_is_gone() -> None:
    s = make()
    parent, child = group(2, list(range(40)), max_tokens=5)
    s.add(parent)
    s.add(child)
    step(s)  # parent prefills; the child waits
    s.abort("s0")
    out = step(s)
    (seq,) = out.batch.seqs
    # The aborted parent's full blocks are still cached: the child hits 32 tokens.
    assert (seq.request_id, seq.start_pos, out.batch.block_copies) == ("s1", 32, [])
    drain(s)
    assert child.num_output_tokens == 5 and all_free(s)


def test_forked_siblings_survive_preemption() -> None:
    s = make(num_blocks=8)
    reqs = group(4, list(range(40)), max_tokens=60)  # 100 tokens each: more than fits
    for r in reqs:
        s.add(r)
    drain(s)
    assert s.num_preemptions > 0
    assert all(r.num_output_tokens == 60 for r in reqs)
    assert all(r.output_token_ids == reqs[0].output_token_ids for r in reqs)
    assert all_free(s)


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=60), min_size=1, max_size=6),
    priorities=st.lists(st.integers(-3, 3), min_size=6, max_size=6),
    n=st.integers(1, 4),
    budget=st.integers(1, 64),
    num_blocks=st.integers(5, 24),
    max_tokens=st.integers(1, 20),
    abort_at=st.integers(0, 30),
)
def test_random_priority_and_fork_workloads_finish_and_free_every_block(
    prompts: list[list[int]],
    priorities: list[int],
    n: int,
    budget: int,
    num_blocks: int,
    max_tokens: int,
    abort_at: int,
) -> None:
    config = SchedulerConfig(max_num_batched_tokens=budget, policy="priority")
    s = Scheduler(config, KVCacheManager(num_blocks, BS))
    requests: list[Request] = []
    for i, prompt in enumerate(prompts):
        siblings = [req(f"{i}-{j}", prompt, max_tokens, priorities[i]) for j in range(n)]
        for sibling in siblings[1:]:
            sibling.fork_parent = siblings[0]
        requests += siblings
    for r in requests:
        s.add(r)
    for k in range(5000):
        if not s.has_work():
            break
        if k == abort_at:
            s.abort("0-0")  # a parent: its siblings fall back to their own prefill
        out = step(s)
        assert out.batch.num_tokens <= budget
        held = sum(1 for b in s.kv.pool.blocks if b.ref_cnt > 0)
        assert held == s.kv.pool.num_blocks - s.kv.pool.num_free_blocks
        tables = [s.kv.block_ids(r.request_id) for r in s.running]
        refs = collections.Counter(b for table in tables for b in table)
        assert all(s.kv.pool.blocks[b].ref_cnt == c for b, c in refs.items())
    assert not s.has_work()
    assert all_free(s)
    done = [r for r in requests if r.request_id != "0-0"]
    assert all(r.num_output_tokens == max_tokens for r in done)
    # Every sample of a prompt got the stand-in model's tokens for that prompt.
    for r in done:
        assert r.output_token_ids == [
            1000 + (len(r.prompt_token_ids) + t) % 1000 for t in range(max_tokens)
        ]
