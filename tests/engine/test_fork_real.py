"""``n > 1`` with a forked block table, on the real tiny model.

The siblings of a request read the prompt KV that the first one computed (shared blocks,
plus a copied last block), so their outputs must be exactly those of the same requests
run one at a time — any mistake in sharing or in the copy changes the logits — while the
KV cache holds the prompt once.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from infergate.engine.core.engine_core import EngineCore
from infergate.engine.core.request import Request
from infergate.engine.core.scheduler import SchedulerConfig, SchedulerOutput
from infergate.engine.interfaces import SamplingParams
from infergate.engine.model_runner import TorchModelRunner
from infergate.engine.tokenizer import Tokenizer

BS = 8
PROMPT = (
    "Large language models generate text one token at a time, and every token they "
    "read is kept as keys and values in a paged cache."
)
NEW = 24


def make_core(model_dir: Path, prefix_caching: bool) -> EngineCore:
    runner = TorchModelRunner.from_model_dir(
        model_dir, block_size=BS, num_blocks=96, device="cpu", dtype="float32"
    )
    # A 16-token budget chunks the prompt's prefill over several steps.
    config = SchedulerConfig(max_num_batched_tokens=16, max_model_len=256)
    return EngineCore(
        runner, config, tokenizer=Tokenizer(model_dir), enable_prefix_caching=prefix_caching
    )


def samples(prompt: list[int], n: int, forked: bool) -> list[Request]:
    base = SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True, seed=1234)
    reqs = [Request(f"r{j}", prompt, replace(base, seed=1234 + j)) for j in range(n)]
    if forked:
        for sibling in reqs[1:]:
            sibling.fork_parent = reqs[0]
    return reqs


def run(core: EngineCore, reqs: list[Request]) -> tuple[int, int]:
    """Run to the end; the peak number of KV blocks in use, and the tokens computed."""
    for r in reqs:
        core.add_request(r)
    pool = core.kv.pool
    peak = computed = 0
    while core.has_work():
        before = core.scheduler.schedule

        def counted(schedule: Any = before) -> SchedulerOutput:
            nonlocal computed
            out = schedule()
            computed += out.batch.num_tokens
            return out

        core.scheduler.schedule = counted  # type: ignore[method-assign]
        core.step()
        core.scheduler.schedule = before  # type: ignore[method-assign]
        peak = max(peak, pool.num_blocks - pool.num_free_blocks)
    assert pool.num_free_blocks == pool.num_blocks
    return peak, computed


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n4_forked_matches_one_by_one_and_holds_the_prompt_once(
    tiny_model_dir: Path, prefix_caching: bool
) -> None:
    prompt = Tokenizer(tiny_model_dir).encode(PROMPT)
    assert len(prompt) % BS, "the last prompt block must be partial (the copied one)"
    core = make_core(tiny_model_dir, prefix_caching)
    forked = samples(prompt, 4, forked=True)
    peak, computed = run(core, forked)

    for j, alone in enumerate(samples(prompt, 4, forked=False)):
        run(make_core(tiny_model_dir, prefix_caching), [alone])
        assert forked[j].output_token_ids == alone.output_token_ids, f"sample {j}"
    assert len({tuple(r.output_token_ids) for r in forked}) == 4  # seeds differ

    prompt_blocks = -(-len(prompt) // BS)
    per_sequence = -(-(len(prompt) + NEW) // BS)
    shared = (len(prompt) - 1) // BS
    assert peak == shared + 4 * (per_sequence - shared)
    assert peak < 4 * prompt_blocks  # less than the prompt four times, outputs included
    # Only the first sample computed the prompt; each sibling its last token, then all
    # decode (the last output token is sampled, never computed).
    assert computed == len(prompt) + 3 + 4 * (NEW - 1)
    # The siblings report the prompt's own prefix-cache hit (none here), not the fork.
    assert all(r.num_cached_tokens == 0 for r in forked)
