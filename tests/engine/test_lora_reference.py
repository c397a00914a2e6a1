"""Batched multi-LoRA against `transformers` + `peft` loading the same PEFT adapters.

The adapters are random (non-zero B) PEFT directories written by ``make_tiny_loras``;
`peft` loads them onto the Hugging Face model as the reference. Our runner must match
its logits within float32 tolerance and its greedy continuation token for token, alone
and in a batch mixing two adapters and the base model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from infergate.engine.interfaces import ScheduledBatch, ScheduledSeq
from infergate.engine.lora.runner import attach_torch_lora
from infergate.engine.lora.tiny import VARIANTS, make_tiny_lora
from infergate.engine.model_runner import TorchModelRunner
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from .test_reference import PROMPTS, Seq, drive

NEW_TOKENS = 16


@pytest.fixture(scope="module", params=["tiny_model_dir", "tiny_qwen3_dir"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    d: Path = request.getfixturevalue(request.param)
    out = tmp_path_factory.mktemp("adapters")
    loras = [
        make_tiny_lora(d, out / f"lora-{i}", seed=100 + i, rank=r, target_modules=t)
        for i, (t, r) in enumerate(VARIANTS)
    ]
    tok = AutoTokenizer.from_pretrained(d)
    return d, loras, [tok(p).input_ids for p in PROMPTS]


def hf_model(d: Path, lora: Path | None) -> torch.nn.Module:
    base = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    if lora is None:
        return base
    return PeftModel.from_pretrained(base, str(lora)).eval()


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def lora_runner(d: Path, loras: list[Path], max_loras: int = 2) -> TorchModelRunner:
    runner = TorchModelRunner.from_model_dir(
        d, block_size=4, num_blocks=512, device="cpu", kv_cache_dtype="float32"
    )
    lora = attach_torch_lora(runner, max_loras=max_loras, max_lora_rank=16, max_cpu_loras=4)
    for i, path in enumerate(loras):
        lora.manager.add(f"lora-{i}", str(path))
    return runner


def test_adapter_logits_match_peft(setup) -> None:
    d, loras, prompts = setup
    runner = lora_runner(d, loras)
    ids = prompts[0]
    blocks = list(range(-(-len(ids) // 4)))
    for i, path in enumerate(loras):
        with torch.no_grad():
            ref = hf_model(d, path)(torch.tensor([ids])).logits[0, -1:]
            base = hf_model(d, None)(torch.tensor([ids])).logits[0, -1:]
        seq = ScheduledSeq(f"x{i}", ids, 0, blocks, True, lora_name=f"lora-{i}")
        got = runner.compute_logits(ScheduledBatch([seq]))
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        assert (ref - base).abs().max() > 0.1, "the adapter must change the logits"


def test_greedy_tokens_match_peft_alone_and_in_a_mixed_batch(setup) -> None:
    d, loras, prompts = setup
    # Reference: each (prompt, adapter) pair alone in transformers + peft.
    cases = [("a", prompts[0], 0), ("b", prompts[1], 1), ("c", prompts[2], None),
             ("d", prompts[3], 0)]  # fmt: skip
    want = {rid: hf_greedy(hf_model(d, None if i is None else loras[i]), p)
            for rid, p, i in cases}  # fmt: skip
    assert want["a"] != hf_greedy(hf_model(d, None), prompts[0])
    # Alone, one request per runner step loop.
    for rid, p, i in cases:
        runner = lora_runner(d, loras)
        seq = Seq(rid, p, chunk=5)
        _drive_lora(runner, [seq], {rid: None if i is None else f"lora-{i}"})
        assert seq.out == want[rid], rid
    # Together: two adapters and the base model share every step (chunked prefills and
    # decodes mixed), and the slots are shared by requests of the same adapter.
    runner = lora_runner(d, loras)
    seqs = [Seq(rid, p, chunk=6) for rid, p, _ in cases]
    _drive_lora(runner, seqs, {rid: None if i is None else f"lora-{i}" for rid, _, i in cases})
    for s in seqs:
        assert s.out == want[s.rid], s.rid


def test_slots_swap_lru_when_adapters_outnumber_them(setup) -> None:
    d, loras, prompts = setup
    runner = lora_runner(d, loras, max_loras=1)
    assert runner.lora is not None
    for i in (0, 1, 2, 0):
        seq = Seq(f"r{i}", prompts[i], chunk=64)
        _drive_lora(runner, [seq], {seq.rid: f"lora-{i}"}, new_tokens=4)
        assert seq.out == hf_greedy(hf_model(d, loras[i]), prompts[i], 4)
    assert runner.lora.manager.slots.loads == 4  # every switch reloaded the single slot


def _drive_lora(runner: TorchModelRunner, seqs: list[Seq], names: dict[str, str | None],
                new_tokens: int = NEW_TOKENS) -> None:  # fmt: skip
    """test_reference.drive, with each ScheduledSeq tagged with its adapter."""
    execute = runner.execute

    def tagged(batch: ScheduledBatch) -> list[int | None]:
        for s in batch.seqs:
            s.lora_name = names[s.request_id]
        return execute(batch)

    runner.execute = tagged  # type: ignore[method-assign]
    try:
        drive(runner, seqs, new_tokens)
    finally:
        del runner.execute  # back to the class's method
