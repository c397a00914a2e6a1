"""The KV cache's dtype (``--kv-cache-dtype``) and size (``--kv-cache-memory-bytes``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from infergate.engine.interfaces import SamplingParams, ScheduledBatch, ScheduledSeq
from infergate.engine.model_runner import TorchModelRunner, kv_block_bytes

GREEDY = SamplingParams(temperature=0.0)


def decode(
    runner: TorchModelRunner, prompt: list[int], steps: int, forced: list[int] | None = None
) -> torch.Tensor:
    """Logits [steps, vocab] of a prefill then `steps - 1` decode steps, each fed the
    previous step's greedy token, or `forced`'s (teacher forcing)."""
    table = list(range(-(-(len(prompt) + steps) // runner.block_size)))
    rows = [runner.compute_logits(ScheduledBatch([ScheduledSeq("r", prompt, 0, table, True)]))]
    for i in range(steps - 1):
        token = forced[i] if forced is not None else int(rows[-1][0].argmax())
        seq = ScheduledSeq("r", [token], len(prompt) + i, table, True, GREEDY, i + 1)
        rows.append(runner.compute_logits(ScheduledBatch([seq])))
    return torch.cat(rows)


def test_auto_keeps_bfloat16_kv_for_a_float32_model_on_cpu(tiny_model_dir: Path) -> None:
    auto = TorchModelRunner.from_model_dir(tiny_model_dir, device="cpu", num_blocks=8)
    assert (auto.dtype, auto.kv_cache_dtype) == (torch.float32, torch.bfloat16)
    assert all(c.dtype == torch.bfloat16 for c in auto.kv_caches)
    wide = TorchModelRunner.from_model_dir(
        tiny_model_dir, device="cpu", num_blocks=8, kv_cache_dtype="float32"
    )
    assert all(c.dtype == torch.float32 for c in wide.kv_caches)
    half = TorchModelRunner.from_model_dir(tiny_model_dir, device="cpu", num_blocks=8,
                                           dtype="bfloat16")  # fmt: skip
    assert half.kv_cache_dtype == torch.bfloat16  # auto: the model's own dtype


def test_bfloat16_cache_stays_within_rounding_of_a_float32_cache(tiny_model_dir: Path) -> None:
    """A float32 cache's greedy run of 48 tokens, replayed on a bfloat16 cache: only the
    stored K/V are rounded (attention reads them back in float32), so every logprob stays
    within 0.15 (measured: 0.09 at most) and the top token is the same wherever float32's
    two best logits are 0.2 apart (the random tiny model has near-ties, where greedy runs
    may part)."""
    runners = {
        kv: TorchModelRunner.from_model_dir(
            tiny_model_dir, device="cpu", num_blocks=16, kv_cache_dtype=kv
        )
        for kv in ("float32", "bfloat16")
    }
    for i in range(3):
        prompt = list(range(10 + i, 40 + 3 * i))
        ref = decode(runners["float32"], prompt, 48)
        bf16 = decode(runners["bfloat16"], prompt, 48, forced=ref.argmax(-1).tolist())
        assert (ref.log_softmax(-1) - bf16.log_softmax(-1)).abs().max() <= 0.15
        top2 = ref.topk(2).values
        clear = top2[:, 0] - top2[:, 1] > 0.2
        assert torch.equal(ref.argmax(-1)[clear], bf16.argmax(-1)[clear])
        assert clear.sum() >= 24  # not vacuous


def test_kv_cache_memory_bytes_sizes_the_cache(tiny_model_dir: Path) -> None:
    r = TorchModelRunner.from_model_dir(
        tiny_model_dir, device="cpu", max_model_len=256, kv_cache_memory_bytes=2 * 2**20
    )
    per_block = kv_block_bytes(r.config, r.block_size, torch.bfloat16)
    assert r.num_blocks == 2 * 2**20 // per_block
    pinned = TorchModelRunner.from_model_dir(
        tiny_model_dir, device="cpu", num_blocks=12, kv_cache_memory_bytes=2 * 2**20
    )
    assert pinned.num_blocks == 12  # an explicit block count wins, as vLLM's override
    with pytest.raises(ValueError, match="fewer than one 256-token sequence"):
        TorchModelRunner.from_model_dir(
            tiny_model_dir, device="cpu", max_model_len=256, kv_cache_memory_bytes=per_block
        )


def test_an_unknown_kv_cache_dtype_is_a_clear_error(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8: choose one of auto, bfloat16"):
        TorchModelRunner.from_model_dir(tiny_model_dir, device="cpu", kv_cache_dtype="fp8")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-cache-dtype", "float16"], "--kv-cache-dtype float16: choose one of auto"),
        (["--kv-cache-memory-bytes", "0"], "--kv-cache-memory-bytes"),
    ],
)
def test_engine_serve_refuses_bad_kv_cache_flags(
    infergate_cli: list[str], tiny_model_dir: Path, args: list[str], message: str
) -> None:
    result = subprocess.run(
        [*infergate_cli, "engine", "serve", str(tiny_model_dir), "--device", "cpu", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
