"""Model loading: config parsing, RoPE scaling, sharded/dummy weights, dtype, bad input."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from infergate.engine.interfaces import ScheduledBatch, ScheduledSeq
from infergate.engine.model_runner import CPU_KV_CACHE_BYTES, TorchModelRunner, kv_block_bytes
from infergate.engine.models import ModelConfig, UnsupportedModelError, model_class
from infergate.engine.models.layers import rope_inv_freq
from infergate.engine.tiny_model import make_tiny_model
from safetensors.torch import load_file, save_file

PROMPT = list(range(10, 40))


def last_logits(runner: TorchModelRunner, prompt: list[int] = PROMPT) -> torch.Tensor:
    blocks = list(range(-(-len(prompt) // runner.block_size)))
    return runner.compute_logits(ScheduledBatch([ScheduledSeq("x", prompt, 0, blocks, True)]))


def cpu_runner(d: Path, **kw) -> TorchModelRunner:
    kw.setdefault("num_blocks", 16)
    return TorchModelRunner.from_model_dir(d, device="cpu", **kw)


def test_runner_attributes(tiny_model_dir: Path, tiny_qwen3_dir: Path) -> None:
    llama = cpu_runner(tiny_model_dir, max_model_len=256)
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) <= set(llama.eos_token_ids)
    assert (llama.block_size, llama.num_blocks, llama.max_model_len) == (16, 16, 256)
    assert llama.dtype == torch.float32  # "auto" on CPU
    assert type(llama.model).__name__ == "LlamaForCausalLM"
    qwen = cpu_runner(tiny_qwen3_dir)
    assert type(qwen.model).__name__ == "Qwen3ForCausalLM"
    assert qwen.max_model_len == 4096
    assert qwen.model.lm_head.weight is qwen.model.model.embed_tokens.weight  # tied


def test_auto_num_blocks_on_cpu_is_bounded(tiny_model_dir: Path) -> None:
    r = TorchModelRunner.from_model_dir(tiny_model_dir, device="cpu", max_model_len=512)
    per_seq = 512 // r.block_size
    assert per_seq <= r.num_blocks <= 32 * per_seq
    per_block = kv_block_bytes(r.config, r.block_size, r.kv_cache_dtype)
    assert r.num_blocks * per_block <= max(CPU_KV_CACHE_BYTES, per_seq * per_block)


def test_sharded_checkpoint_loads_the_same_weights(tmp_path: Path, tiny_model_dir: Path) -> None:
    sharded = make_tiny_model(tmp_path / "sharded", arch="llama", seed=0, num_shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    torch.testing.assert_close(
        last_logits(cpu_runner(sharded)), last_logits(cpu_runner(tiny_model_dir)), rtol=0, atol=0
    )


def test_missing_shard_is_a_clear_error(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "m", arch="qwen3", num_shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="00002"):
        cpu_runner(d)


def test_dummy_load_format_needs_no_weights(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    d = tmp_path / "cfg-only"
    d.mkdir()
    shutil.copy(tiny_qwen3_dir / "config.json", d / "config.json")
    with pytest.raises(FileNotFoundError, match="dummy"):
        cpu_runner(d)
    a = last_logits(cpu_runner(d, load_format="dummy"))
    b = last_logits(cpu_runner(d, load_format="dummy"))
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # seeded
    real = last_logits(cpu_runner(tiny_qwen3_dir))
    assert not torch.allclose(a, real)


def test_bfloat16_on_cpu_tracks_float32(tiny_model_dir: Path) -> None:
    bf = cpu_runner(tiny_model_dir, dtype="bfloat16")
    assert bf.kv_caches[0].dtype == torch.bfloat16
    fp = last_logits(cpu_runner(tiny_model_dir))
    torch.testing.assert_close(last_logits(bf), fp, atol=0.3, rtol=0.05)


def test_bad_dtype_and_format(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        cpu_runner(tiny_model_dir, dtype="int3")
    with pytest.raises(ValueError, match="load format"):
        cpu_runner(tiny_model_dir, load_format="pt")
    with pytest.raises(FileNotFoundError, match=r"no \*\.gguf weights"):
        cpu_runner(tiny_model_dir, load_format="gguf")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        cpu_runner(tiny_model_dir, max_model_len=10**6)


def test_checkpoint_mismatches_are_errors(tmp_path: Path, tiny_model_dir: Path) -> None:
    d = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, d)
    weights = load_file(d / "model.safetensors")
    missing = dict(weights)
    del missing["model.layers.1.self_attn.k_proj.weight"]
    save_file(missing, d / "model.safetensors")
    with pytest.raises(ValueError, match="missing weights"):
        cpu_runner(d)
    extra = dict(weights, **{"model.layers.0.mlp.extra.weight": torch.zeros(2)})
    save_file(extra, d / "model.safetensors")
    with pytest.raises(ValueError, match="does not use"):
        cpu_runner(d)
    wrong = dict(weights, **{"model.norm.weight": torch.zeros(3)})
    save_file(wrong, d / "model.safetensors")
    with pytest.raises(ValueError, match="shape"):
        cpu_runner(d)


def test_unsupported_configs_are_rejected(tiny_model_dir: Path) -> None:
    base = json.loads((tiny_model_dir / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="GPT2"):
        model_class(ModelConfig.from_dict({**base, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(UnsupportedModelError, match="gelu"):
        ModelConfig.from_dict({**base, "hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError, match="hidden_size"):
        ModelConfig.from_dict({k: v for k, v in base.items() if k != "hidden_size"})


def test_transformers_v5_rope_parameters_are_understood(tiny_model_dir: Path) -> None:
    base = json.loads((tiny_model_dir / "config.json").read_text())
    v4 = ModelConfig.from_dict(base)
    v5_dict = {k: v for k, v in base.items() if k not in ("rope_scaling", "rope_theta")}
    v5_dict["rope_parameters"] = {**base["rope_scaling"], "rope_theta": base["rope_theta"]}
    v5 = ModelConfig.from_dict(v5_dict)
    assert v5.rope_theta == v4.rope_theta
    assert v5.rope_scaling is not None and v5.rope_scaling["rope_type"] == "llama3"


def test_llama3_rope_scaling_regimes() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    plain = rope_inv_freq(16, 500000.0, None)
    scaled = rope_inv_freq(16, 500000.0, scaling)
    wavelen = 2 * math.pi / plain
    short = wavelen < 1024 / 4.0
    long = wavelen > 1024 / 1.0
    mid = ~short & ~long
    assert short.any() and long.any() and mid.any()  # the tiny model exercises all three
    torch.testing.assert_close(scaled[short], plain[short])
    torch.testing.assert_close(scaled[long], plain[long] / 8.0)
    assert ((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / 8.0)).all()


def test_runner_rejects_inconsistent_steps(tiny_model_dir: Path) -> None:
    r = cpu_runner(tiny_model_dir, block_size=4, max_model_len=64)
    cases = [
        (ScheduledSeq("a", [1, 2, 3, 4, 5], 0, [0], True), "block_table"),
        (ScheduledSeq("a", [1], 0, [99], True), "out of range"),
        (ScheduledSeq("a", [10**6], 0, [0], True), "vocabulary"),
        (ScheduledSeq("a", [1], 64, list(range(16)), True), "max_model_len"),
        (ScheduledSeq("a", [], 3, [0], True), "at least one token"),
    ]
    for seq, message in cases:
        with pytest.raises(ValueError, match=message):
            r.execute(ScheduledBatch([seq]))
    # An empty step and a non-sampling chunk are fine.
    assert r.execute(ScheduledBatch([])) == []
    assert r.execute(ScheduledBatch([ScheduledSeq("a", [1, 2], 0, [0], False)])) == [None]


def test_loading_a_model_imports_no_compiler(tiny_model_dir: Path) -> None:
    """Building the model on the meta device skips torch.nn.init and materializes it with
    torch.empty: Embedding's normal_ and empty_like on meta would import torch._dynamo,
    triton and sympy (~144 MiB resident) in an engine that never compiles."""
    code = (
        "import sys\n"
        "from infergate.engine.model_runner import TorchModelRunner\n"
        f"TorchModelRunner.from_model_dir({str(tiny_model_dir)!r}, device='cpu', num_blocks=4)\n"
        "print(sorted(m for m in ('torch._dynamo', 'triton', 'sympy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
