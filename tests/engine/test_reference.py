"""Our Llama/Qwen3 + paged KV cache against Hugging Face `transformers` on the same weights.

TorchModelRunner is driven with hand-built ScheduledBatch steps (a stand-in for the
scheduler): plain prefill, chunked prefill, prefix hits on another sequence's blocks, and
mixed batches of decodes and prefill chunks. Every case must reproduce `transformers`'
greedy continuation token for token, and its logits within float32 tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from infergate.engine.interfaces import SamplingParams, ScheduledBatch, ScheduledSeq
from infergate.engine.model_runner import TorchModelRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
PROMPTS = [
    "Once upon a time there was a small town by the sea.",
    "The scheduler decides which requests run in each step, mixing new prompts",
    "Hello, world! What is the capital of France?",
    "Large language models generate text one token at a time.",
]


@dataclass
class Seq:
    rid: str
    prompt: list[int]
    chunk: int  # max prompt tokens per step
    reuse: tuple[str, int] | None = None  # (other seq, number of its full blocks to share)
    after: str | None = None  # join the batch once this seq has finished its prefill
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the cache
    out: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out


def drive(runner: TorchModelRunner, seqs: list[Seq], new_tokens: int = NEW_TOKENS) -> int:
    """Step all sequences together until each has `new_tokens` outputs; return #mixed steps."""
    by_id = {s.rid: s for s in seqs}
    next_block = iter(range(runner.num_blocks))
    mixed_steps = 0
    while any(len(s.out) < new_tokens for s in seqs):
        step: list[tuple[Seq, ScheduledSeq]] = []
        for s in seqs:
            if len(s.out) >= new_tokens:
                continue
            if s.after and by_id[s.after].computed < len(by_id[s.after].prompt):
                continue
            if s.reuse and not s.blocks:
                other, n = by_id[s.reuse[0]], s.reuse[1]
                s.blocks = other.blocks[:n]
                s.computed = n * runner.block_size
            remaining = len(s.tokens) - s.computed
            n_new = min(remaining, s.chunk) if s.computed < len(s.prompt) else 1
            todo = s.tokens[s.computed : s.computed + n_new]
            while len(s.blocks) * runner.block_size < s.computed + n_new:
                s.blocks.append(next(next_block))
            sample = s.computed + n_new == len(s.tokens)
            step.append(
                (
                    s,
                    ScheduledSeq(
                        request_id=s.rid,
                        token_ids=todo,
                        start_pos=s.computed,
                        block_table=list(s.blocks),
                        sample=sample,
                        sampling=GREEDY,
                        num_generated=len(s.out),
                    ),
                )
            )
        kinds = {len(sch.token_ids) > 1 for _, sch in step}
        mixed_steps += kinds == {True, False}
        results = runner.execute(ScheduledBatch([sch for _, sch in step]))
        for (s, sch), tok in zip(step, results, strict=True):
            s.computed += len(sch.token_ids)
            assert (tok is not None) == sch.sample
            if tok is not None:
                s.out.append(tok)
    return mixed_steps


@pytest.fixture(scope="module", params=["tiny_model_dir", "tiny_qwen3_dir"])
def model(request: pytest.FixtureRequest) -> tuple[Path, torch.nn.Module, list[list[int]]]:
    d: Path = request.getfixturevalue(request.param)
    tok = AutoTokenizer.from_pretrained(d)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return d, hf, [tok(p).input_ids for p in PROMPTS]


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def runner_for(d: Path, block_size: int) -> TorchModelRunner:
    return TorchModelRunner.from_model_dir(
        d, block_size=block_size, num_blocks=256, device="cpu", kv_cache_dtype="float32"
    )


def test_logits_match_transformers_at_every_position(model) -> None:
    d, hf, prompts = model
    runner = runner_for(d, block_size=4)
    ids = prompts[0] + prompts[1]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    # Prefill the first 10 tokens, then feed the rest one decode step at a time.
    blocks = list(range(-(-len(ids) // 4)))
    got = [runner.compute_logits(ScheduledBatch([ScheduledSeq("x", ids[:10], 0, blocks, True)]))]
    for pos in range(10, len(ids)):
        step = ScheduledSeq("x", [ids[pos]], pos, blocks, True)
        got.append(runner.compute_logits(ScheduledBatch([step])))
    ours = torch.cat(got)
    torch.testing.assert_close(ours, ref[9:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_size", [16, 4])
def test_plain_prefill_then_decode(model, block_size: int) -> None:
    d, hf, prompts = model
    runner = runner_for(d, block_size)
    seq = Seq("a", prompts[0], chunk=10_000)
    drive(runner, [seq])
    assert seq.out == hf_greedy(hf, prompts[0])


def test_chunked_prefill(model) -> None:
    d, hf, prompts = model
    runner = runner_for(d, block_size=4)
    seq = Seq("a", prompts[1], chunk=5)  # chunks straddle block boundaries
    drive(runner, [seq])
    assert seq.out == hf_greedy(hf, prompts[1])


def test_prefix_hit_and_mixed_batches(model) -> None:
    d, hf, prompts = model
    runner = runner_for(d, block_size=4)
    shared = prompts[0][:12]  # 3 full blocks of 4
    b_prompt = shared + prompts[2][:9]
    seqs = [
        Seq("a", prompts[0], chunk=7),
        Seq("b", b_prompt, chunk=6, reuse=("a", 3), after="a"),
        Seq("c", prompts[3], chunk=3),
        Seq("d", prompts[1], chunk=64),
    ]
    mixed = drive(runner, seqs)
    assert mixed > 0, "the scenario must put decodes and prefill chunks in one batch"
    b = seqs[1]
    assert b.blocks[:3] == seqs[0].blocks[:3], "b must read a's cached blocks"
    for s in seqs:
        assert s.out == hf_greedy(hf, s.prompt), s.rid
    # A degenerate model (one token forever) would make the comparison meaningless.
    assert len({t for s in seqs for t in s.out}) > 8


@pytest.mark.gpu
def test_cuda_runner_matches_transformers(model) -> None:
    """Same mixed scenario on CUDA: float32 must match exactly; "auto" picks bfloat16."""
    d, hf, prompts = model
    runner = TorchModelRunner.from_model_dir(d, block_size=16, num_blocks=64, device="cuda",
                                             dtype="float32")  # fmt: skip
    seqs = [Seq("a", prompts[0], chunk=7), Seq("b", prompts[1], chunk=64),
            Seq("c", prompts[0][:16] + prompts[3][:5], chunk=5, reuse=("a", 1), after="a")]  # fmt: skip
    drive(runner, seqs)
    for s in seqs:
        assert s.out == hf_greedy(hf, s.prompt), s.rid
    auto = TorchModelRunner.from_model_dir(d, num_blocks=64, device="cuda")
    assert auto.dtype == torch.bfloat16
    ids = prompts[2]
    step = ScheduledSeq("x", ids, 0, list(range(-(-len(ids) // 16))), True)
    got = auto.compute_logits(ScheduledBatch([step])).cpu()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1:]
    torch.testing.assert_close(got, ref, atol=0.5, rtol=0.1)
