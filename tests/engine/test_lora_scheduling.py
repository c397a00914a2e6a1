"""LoRA in the scheduler and the prefix cache: the --max-loras limit per batch, blocks
keyed by adapter, KV events naming the adapter, and the slot/CPU-pool LRU."""

from __future__ import annotations

import pytest
from infergate.engine.core.kv_cache_manager import KVCacheManager
from infergate.engine.core.request import Request
from infergate.engine.core.scheduler import Scheduler, SchedulerConfig
from infergate.engine.interfaces import SamplingParams
from infergate.engine.kv_events import BlockStored
from infergate.engine.lora.errors import LoRAError
from infergate.engine.lora.manager import LoRAManager, LoRARequest, SlotTable

from infergate.wire.block_hash import block_hashes

from .test_scheduler import BS, drain, step

PROMPT = list(range(1, 3 * BS + 5))


def lora(name: str, int_id: int = 1) -> LoRARequest:
    return LoRARequest(name, int_id, f"/adapters/{name}", name)


def make(max_loras: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=4096, max_loras=max_loras),
        KVCacheManager(256, BS, enable_events=True),
    )


def req(rid: str, adapter: LoRARequest | None, prompt: list[int] = PROMPT) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4), lora=adapter)


def test_batch_never_holds_more_adapters_than_max_loras() -> None:
    s = make(max_loras=2)
    a, b, c = lora("a", 1), lora("b", 2), lora("c", 3)
    for i, adapter in enumerate([a, b, c, a, None, c]):
        s.add(req(f"r{i}", adapter, [100 + i, *PROMPT]))
    out = step(s)
    admitted = [seq.request_id for seq in out.batch.seqs]
    # c (twice) waits for a slot; base-model and same-adapter requests behind it go ahead.
    assert admitted == ["r0", "r1", "r3", "r4"]
    assert {seq.lora_name for seq in out.batch.seqs} == {"a", "b", None}
    assert [r.request_id for r in s.waiting] == ["r2", "r5"]  # order kept
    assert s.waiting_loras() == {"c"} and s.running_loras() == {"a", "b"}
    seen: set[str] = set()
    while s.has_work():
        batch = step(s).batch
        names = {q.lora_name for q in batch.seqs if q.lora_name}
        assert len(names) <= 2
        seen |= names
    assert seen >= {"c"}


def test_prefix_cache_is_keyed_by_adapter() -> None:
    s = make(max_loras=4)
    s.add(req("base", None))
    drain(s)
    s.add(req("x", lora("x")))
    s.add(req("base2", None))
    out = step(s)
    hits = {r.request_id: r.num_cached_tokens for r in out.requests}
    assert hits == {"x": 0, "base2": 3 * BS}  # the adapter's KV differs from the base's
    drain(s)
    s.add(req("x2", lora("x")))
    assert step(s).requests[0].num_cached_tokens == 3 * BS


def test_block_hashes_and_events_carry_the_adapter() -> None:
    s = make(max_loras=1)
    s.add(req("x", lora("tenant-a", 7)))
    drain(s)
    stored = [e for e in s.kv.pool.drain_events() if isinstance(e, BlockStored)]
    assert stored and all((e.lora_id, e.lora_name) == (7, "tenant-a") for e in stored)
    # What a router computes from the request's model name alone:
    expected = block_hashes(PROMPT, BS, lora_name="tenant-a")
    assert stored[0].block_hashes == expected[: len(stored[0].block_hashes)]
    assert expected != block_hashes(PROMPT, BS)
    assert block_hashes(PROMPT, BS, lora_name="a", cache_salt="b") != block_hashes(
        PROMPT, BS, lora_name="ab"
    )


def test_slot_table_lru_spares_the_adapters_of_the_batch() -> None:
    t = SlotTable(2)
    assert t.assign(["a", "b"])[1] == [("a", 0), ("b", 1)]
    assert t.assign(["a"])[1] == []  # resident: no load; a becomes most recent
    slots, new = t.assign(["c", "a"])
    assert new == [("c", 1)] and slots == {"c": 1, "a": 0}  # b was least recently used
    with pytest.raises(LoRAError, match="max-loras"):
        t.assign(["a", "b", "c"])
    assert t.loads == 3


def test_manager_reregistration_changes_the_cache_key_and_errors_are_clear() -> None:
    m = LoRAManager(max_loras=1, max_lora_rank=8)
    first = m.add("a", "/x")
    with pytest.raises(LoRAError, match="already been loaded"):
        m.add("a", "/x")
    m.remove("a")
    again = m.add("a", "/x")
    assert (first.cache_key, again.cache_key) == ("a", "a@1")
    assert again.int_id != first.int_id
    with pytest.raises(ValueError, match="max-cpu-loras"):
        LoRAManager(max_loras=2, max_lora_rank=8, max_cpu_loras=1)


def test_lora_module_flags_parse_both_vllm_forms() -> None:
    from infergate.engine.lora.options import LoRAModule, parse_lora_modules

    got = parse_lora_modules(
        ["sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "base"}']
    )
    assert got == [LoRAModule("sql", "/a/sql"), LoRAModule("chat", "/a/chat", "base")]
    for bad, message in [
        (["sql"], "name=path"),
        (["{not json"], "invalid JSON"),
        (['{"name": "x"}'], "'path'"),
        (['{"name": "x", "path": "/p", "rank": 8}'], "unknown keys"),
        (["a=/x", "a=/y"], "duplicate"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_lora_modules(bad)
