"""The whole step loop (real scheduler, KV manager with prefix caching, TorchModelRunner)
reproduces `transformers`' greedy tokens — with chunked prefill forced by a small token
budget, with prefix-cache hits, and with several requests sharing every step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from infergate.engine.core.engine_core import EngineCore, RequestOutput
from infergate.engine.core.request import Request
from infergate.engine.core.scheduler import SchedulerConfig
from infergate.engine.interfaces import SamplingParams
from infergate.engine.model_runner import TorchModelRunner
from transformers import AutoModelForCausalLM

NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def hf_greedy(hf: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def run(core: EngineCore, requests: list[Request]) -> dict[str, RequestOutput]:
    for r in requests:
        core.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    final: dict[str, RequestOutput] = {}
    while core.has_work():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                final[out.request_id] = out
    for rid, out in final.items():
        out.new_token_ids = tokens[rid]
    return final


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen3_dir"])
def test_engine_matches_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    d: Path = request.getfixturevalue(fixture)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    runner = TorchModelRunner.from_model_dir(
        d, block_size=4, num_blocks=128, device="cpu", kv_cache_dtype="float32"
    )
    # Budget 6: every prompt below is prefilled in several chunks, next to decodes.
    core = EngineCore(
        runner,
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6, max_model_len=256),
    )
    shared = list(range(20, 41))  # 21 tokens: 5 full blocks of 4 + 1
    first = run(core, [Request("a", [*shared, 7, 8, 9], GREEDY)])
    later = run(
        core,
        [
            Request("b", [*shared, 50, 51], GREEDY),  # prefix hit on a's blocks
            Request("c", list(range(100, 117)), GREEDY),
            Request("d", [*shared[:9], 60], GREEDY),
        ],
    )
    assert first["a"].num_cached_tokens == 0
    assert later["b"].num_cached_tokens >= 20
    assert later["d"].num_cached_tokens >= 8
    prompts = {"a": [*shared, 7, 8, 9], "b": [*shared, 50, 51], "c": list(range(100, 117)),
               "d": [*shared[:9], 60]}  # fmt: skip
    for rid, out in {**first, **later}.items():
        assert out.new_token_ids == hf_greedy(hf, prompts[rid]), rid
    assert len(runner.sampler) == 0
