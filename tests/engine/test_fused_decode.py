"""The CPU decode step's C kernels against the torch ops they replace, and the fused
decode path against the torch path on a quantized tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from infergate.engine.gguf_model import prepare_model_dir
from infergate.engine.interfaces import SamplingParams, ScheduledBatch, ScheduledSeq
from infergate.engine.kernels import cpu_decode
from infergate.engine.model_runner import TorchModelRunner
from infergate.engine.models import fused_decode
from torch.nn import functional as F

from .gguf_files import write_gguf

KERNELS = cpu_decode.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler to build the kernels")
BF16_ULP = 2**-7  # relative spacing of bfloat16 values


def kernels() -> cpu_decode.DecodeKernels:
    assert KERNELS is not None
    return KERNELS


def close_bf16(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to one bfloat16 rounding step (summation orders differ)."""
    torch.testing.assert_close(ours.float(), ref.float(), rtol=BF16_ULP, atol=1e-6)


def test_norms_match_torch() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 96, generator=g), torch.randn(96, generator=g)
    ref = F.rms_norm(x, (96,), w, 1e-5).to(torch.bfloat16)
    close_bf16(kernels().rms_norm(x, w, 1e-5), ref)
    delta = torch.randn(3, 96, generator=g).to(torch.bfloat16)
    h = x.clone()
    out = kernels().add_rms_norm(h, delta, w, 1e-5)
    torch.testing.assert_close(h, x + delta.float())
    close_bf16(out, F.rms_norm(x + delta.float(), (96,), w, 1e-5).to(torch.bfloat16))


def test_silu_mul_matches_torch() -> None:
    inter = 83  # five 16-wide vectors and a tail of three
    gate_up = 4 * torch.randn(2, 2 * inter, generator=torch.Generator().manual_seed(1))
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # e^x's clamp, both signs
    gate_up[1, inter - 2 : inter] = torch.tensor([-90.0, 90.0])  # ...in the tail too
    gate_up = gate_up.bfloat16()
    gate, up = gate_up.split(inter, dim=-1)
    close_bf16(kernels().silu_mul(gate_up, inter), F.silu(gate) * up)


def _paged(
    seq_lens: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype, bs: int = 4
):
    """A random cache of blocks of `bs` (enough for every sequence) and each sequence's
    (scattered) block table."""
    g = torch.Generator().manual_seed(2)
    width = max(-(-n // bs) for n in seq_lens)
    blocks = width * len(seq_lens)
    cache = torch.randn(blocks, 2, bs, kv_heads, dim, generator=g).to(dtype)
    order = torch.randperm(blocks, generator=g).tolist()
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for s, n in enumerate(seq_lens):
        for j in range(-(-n // bs)):
            tables[s, j] = order[width * s + j]
    return cache, tables


def _reference_attention(q, cache, tables, seq_lens, scale):
    """Each sequence's keys and values gathered in order, then torch's sdpa."""
    outs = []
    for s, n in enumerate(seq_lens):
        kv = cache[tables[s].long()].float()  # [W, 2, bs, Hkv, D]
        keys = kv[:, 0].flatten(0, 1)[:n].transpose(0, 1)
        vals = kv[:, 1].flatten(0, 1)[:n].transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q[s].unsqueeze(1), keys, vals, scale=scale, enable_gqa=True
        )
        outs.append(o.reshape(-1))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("seq_lens", "dim", "bs", "heads", "kv_heads"),
    [
        ([1, 7, 16], 8, 4, 6, 2),  # a head dim the vector path does not take
        ([1, 37, 300], 64, 16, 6, 2),  # SmolLM2's: vectors, ranges split across threads
        ([5, 200], 128, 16, 6, 2),  # Llama's
        ([70], 48, 16, 6, 2),  # a multiple of 16 without a constant-width path
        ([40], 128, 16, 36, 1),  # a group too large for the vectors' registers: scalar
    ],
    ids=["dim8", "dim64", "dim128", "dim48", "group36"],
)
@pytest.mark.parametrize("threads", [1, 4])  # 4: each sequence's range split and merged
def test_decode_attention_matches_sdpa_over_the_paged_cache(
    dtype: torch.dtype,
    seq_lens: list[int],
    dim: int,
    bs: int,
    heads: int,
    kv_heads: int,
    threads: int,
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the kernel splits for the calling thread's team
    cache, tables = _paged(seq_lens, heads, kv_heads, dim, dtype, bs)
    q = torch.randn(len(seq_lens), heads, dim, generator=torch.Generator().manual_seed(3))
    step = cpu_decode.DecodeStep(
        positions=torch.tensor([n - 1 for n in seq_lens]),
        slots=torch.arange(len(seq_lens)), tables=tables, seq_lens=torch.tensor(seq_lens),
        table=torch.zeros(max(seq_lens), dim), block_size=bs, num_blocks=cache.shape[0],
    )  # fmt: skip
    try:
        ours = kernels().attention(q, cache, step, kv_heads, 0.35)
    finally:
        torch.set_num_threads(before)
    close_bf16(ours, _reference_attention(q, cache, tables, seq_lens, 0.35))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_store_rotates_and_writes_each_slot(dtype: torch.dtype) -> None:
    heads, kv_heads, dim, bs = 4, 2, 8, 4
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(2, (heads + 2 * kv_heads) * dim, generator=g).bfloat16()
    angles = torch.rand(10, dim // 2, generator=g) * 3
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions, slots = torch.tensor([3, 9]), torch.tensor([5, 22])
    cache = torch.zeros(8, 2, bs, kv_heads, dim, dtype=dtype)
    step = cpu_decode.DecodeStep(
        positions=positions, slots=slots, tables=torch.zeros(2, 1, dtype=torch.int32),
        seq_lens=torch.tensor([1, 1]), table=table, block_size=bs, num_blocks=8,
    )  # fmt: skip
    q = kernels().rope_store(qkv, step, cache, heads, kv_heads, dim)

    def rotate(x: torch.Tensor) -> torch.Tensor:  # the torch path's rotate_half
        cos, sin = table[positions].chunk(2, dim=-1)
        cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([-sin, sin], -1)[:, None]
        half = dim // 2
        return x * cos + torch.cat([x[..., half:], x[..., :half]], -1) * sin

    flat = qkv.float()
    torch.testing.assert_close(q, rotate(flat[:, : heads * dim].view(2, heads, dim)))
    k = rotate(flat[:, heads * dim : (heads + kv_heads) * dim].view(2, kv_heads, dim))
    v = flat[:, (heads + kv_heads) * dim :].view(2, kv_heads, dim)
    for t, slot in enumerate(slots.tolist()):
        torch.testing.assert_close(cache[slot // bs, 0, slot % bs], k[t].to(dtype))
        torch.testing.assert_close(cache[slot // bs, 1, slot % bs], v[t].to(dtype))
    assert int((cache != 0).sum()) == 2 * 2 * kv_heads * dim  # nothing else written


def test_bad_inputs_are_refused_before_any_memory_is_touched() -> None:
    with pytest.raises(ValueError, match=r"contiguous CPU torch\.float32"):
        kernels().rms_norm(torch.ones(2, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match=r"contiguous CPU torch\.bfloat16"):
        kernels().silu_mul(torch.ones(8, 2).bfloat16().t(), 2)
    good = {
        "positions": torch.tensor([3]), "slots": torch.tensor([5]),
        "tables": torch.zeros(1, 2, dtype=torch.int32), "seq_lens": torch.tensor([4]),
    }  # fmt: skip

    def step(indices: dict[str, torch.Tensor]) -> cpu_decode.DecodeStep:
        return cpu_decode.DecodeStep(**indices, table=torch.zeros(8, 4), block_size=4, num_blocks=2)

    checked = step(good)  # in range
    small = torch.zeros(1, 2, 4, 1, 4)  # a cache of fewer blocks than the step was checked for
    with pytest.raises(ValueError, match=r"KV cache \(1, 2, 4, 1, 4\).*need \(2, 2, 4, 1, 4\)"):
        kernels().attention(torch.zeros(1, 1, 4), small, checked, 1, 1.0)
    for name, bad in [("slots", torch.tensor([8])), ("positions", torch.tensor([8])),
                      ("seq_lens", torch.tensor([9])),
                      ("tables", torch.tensor([[0, 2]], dtype=torch.int32))]:  # fmt: skip
        with pytest.raises(ValueError, match="out of the cache's or the table's range"):
            step({**good, name: bad})


def test_a_steps_kernels_refuse_what_the_step_was_not_checked_for() -> None:
    """The per-step path checks caches and hidden states once, then each matmul output."""
    step = cpu_decode.DecodeStep(
        positions=torch.tensor([3]), slots=torch.tensor([5]),
        tables=torch.zeros(1, 2, dtype=torch.int32), seq_lens=torch.tensor([4]),
        table=torch.zeros(8, 4), block_size=4, num_blocks=2,
    )  # fmt: skip
    g = cpu_decode.Geometry(hidden=8, heads=2, kv_heads=1, head_dim=4, inter=6)
    cache, h = torch.zeros(2, 2, 4, 1, 4), torch.zeros(1, 8)
    with pytest.raises(ValueError, match=r"KV cache \(1, 2, 4, 1, 4\)"):
        cpu_decode.StepKernels(kernels(), step, [cache, cache[:1]], g, h)
    with pytest.raises(ValueError, match="hidden states"):
        cpu_decode.StepKernels(kernels(), step, [cache], g, torch.zeros(2, 8))
    run = cpu_decode.StepKernels(kernels(), step, [cache], g, h)
    with pytest.raises(ValueError, match=r"q\|k\|v: need contiguous bf16 \[1, >= 16\]"):
        run.rope_attention(torch.zeros(1, 12, dtype=torch.bfloat16), 0, 1.0)  # too narrow
    with pytest.raises(ValueError, match="residual delta of width 4"):
        run.add_rms_norm(torch.zeros(1, 4, dtype=torch.bfloat16), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match=r"gate\|up: need contiguous bf16"):
        run.silu_mul(torch.zeros(1, 24, dtype=torch.bfloat16)[:, ::2])  # strided
    with pytest.raises(ValueError, match="residual delta: need contiguous bf16"):
        run.add_rms_norm(torch.zeros(1, 8), torch.ones(8), 1e-5)  # float32
    out = run.silu_mul(torch.zeros(1, 12, dtype=torch.bfloat16))
    assert out.shape == (1, 6) and not out.any()


def test_no_compiler_means_torch_ops(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    cpu_decode.load.cache_clear()
    try:
        assert cpu_decode.load() is None
        assert "CPU decode kernels not built" in caplog.text
    finally:
        monkeypatch.undo()
        cpu_decode.load.cache_clear()
    assert cpu_decode.load() is not None


def _decode_logits(runner: TorchModelRunner, fused: bool, monkeypatch: pytest.MonkeyPatch):
    """Logits of 6 greedy decode steps of 3 sequences of different lengths at once, on
    the fused path (each step counted) or with it switched off."""
    calls: list[int] = []
    if fused:
        real = fused_decode.decode

        def counted(*args: Any) -> torch.Tensor:
            calls.append(1)
            return real(*args)

        monkeypatch.setattr(fused_decode, "decode", counted)
    else:
        monkeypatch.setattr(fused_decode, "applies", lambda *a: False)
    greedy = SamplingParams(temperature=0.0)
    prompts = [[5, 17, 99, 3], [200, 201, 202, 7, 8, 9, 10, 11, 12], [42] * 6]
    tables = [list(range(0, 5)), list(range(5, 10)), list(range(10, 15))]
    seqs = [ScheduledSeq(f"r{i}", p, 0, tables[i], True, greedy) for i, p in enumerate(prompts)]
    last = runner.execute(ScheduledBatch(seqs))
    rows = []
    for step in range(6):
        seqs = [
            ScheduledSeq(f"r{i}", [int(last[i] or 0)], len(p) + step, tables[i], True, greedy,
                         step + 1)
            for i, p in enumerate(prompts)
        ]  # fmt: skip
        logits = runner.compute_logits(ScheduledBatch(seqs))
        rows.append(logits)
        last = logits.argmax(-1).tolist()
    monkeypatch.undo()
    assert len(calls) == (6 if fused else 0)
    return torch.stack(rows)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
def test_fused_path_gives_the_torch_paths_logits(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: Q
) -> None:
    """The same greedy tokens and logits to rounding; the fused path is the one a
    quantized CPU model's decode steps take (each step counted)."""
    path = write_gguf(tiny_model_dir, tmp_path / "m.gguf", qtype)
    model_dir = prepare_model_dir(path, tmp_path, tokenizer=False)
    runners = [
        TorchModelRunner.from_model_dir(model_dir, num_blocks=16, device="cpu", dtype="float32")
        for _ in range(2)
    ]
    fused = _decode_logits(runners[0], True, monkeypatch)
    torch_path = _decode_logits(runners[1], False, monkeypatch)
    assert torch.equal(fused.argmax(-1), torch_path.argmax(-1))
    # Bit-identical on the development machine; the bound allows other summation orders.
    torch.testing.assert_close(fused, torch_path, rtol=BF16_ULP, atol=1e-3)
