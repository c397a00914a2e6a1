"""Preemption by recompute on the real tiny model: outputs stay those of `transformers`.

A KV cache too small for all requests at once forces the scheduler to preempt; the
preempted requests are recomputed (mostly from the prefix cache) and must still produce
exactly the greedy continuation of a plain forward-pass loop.
"""

from __future__ import annotations

from pathlib import Path

import torch
from infergate.engine.core.engine_core import EngineCore
from infergate.engine.core.request import Request
from infergate.engine.core.scheduler import SchedulerConfig
from infergate.engine.interfaces import SamplingParams
from infergate.engine.model_runner import TorchModelRunner
from infergate.engine.tokenizer import Tokenizer
from transformers import AutoModelForCausalLM

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a small town by the sea.",
    "How are you today? I am fine, thank you.",
    "Large language models generate text one token at a time.",
]
NEW = 40


def greedy_loop(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_preempted_requests_still_match_transformers(tiny_model_dir: Path) -> None:
    tok = Tokenizer(tiny_model_dir)
    runner = TorchModelRunner.from_model_dir(
        tiny_model_dir, block_size=8, num_blocks=20, device="cpu", dtype="float32"
    )
    core = EngineCore(
        runner, SchedulerConfig(max_num_batched_tokens=24, max_model_len=160), tokenizer=tok
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    requests = [Request(str(i), tok.encode(p), params) for i, p in enumerate(PROMPTS)]
    for request in requests:
        core.add_request(request)
    while core.has_work():
        core.step()
    assert core.scheduler.num_preemptions > 0, "the cache must be small enough to preempt"
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for request in requests:
        assert request.output_token_ids == greedy_loop(hf, request.prompt_token_ids)
