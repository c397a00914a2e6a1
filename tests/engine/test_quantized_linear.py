"""GGUF weights kept quantized (``--quantization gguf``) against their dequantized values.

Blocks are made by gguf's own quantizers (``gguf.quants.quantize``), so the unpacking
is checked against code the engine did not write: codes and scales reproduce
``gguf.quants.dequantize`` bit for bit, and the packed layout torch's int4 kernel reads
gives those values back (its float32 path, exact up to the rounding of ``(q − 8)·s +
z``). The serving path rounds activations, scales and outputs to bfloat16, so it is
held to bfloat16's precision; a wrong nibble order or scale is off by the weights'
whole size. Then a tiny model served from a quantized GGUF keeps the float32 path's
greedy tokens wherever the float32 path's choice is not a near tie.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from infergate.engine.gguf_model import prepare_model_dir
from infergate.engine.interfaces import SamplingParams, ScheduledBatch, ScheduledSeq
from infergate.engine.kernels import cpu_decode
from infergate.engine.model_runner import TorchModelRunner
from infergate.engine.models.quantized import (
    EXACT_ROWS,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedTensor,
    pack_int4,
)
from torch.nn import functional as F

from .gguf_files import write_gguf

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
BF16_RTOL = 2e-2  # three bfloat16 roundings (input, scales, output) on sums of 96 terms


def quantized(qtype: Q, rows: int, cols: int, seed: int = 0) -> QuantizedTensor:
    """A rows x cols matrix of weight-like values (an offset per row, so Q4_1's minimum
    matters) quantized by gguf."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, cols)) * 0.05 + rng.standard_normal((rows, 1)) * 0.02
    raw = gguf.quants.quantize(values.astype(np.float32), qtype)
    return QuantizedTensor(qtype.name, torch.from_numpy(raw.copy()), (rows, cols))


def reference(t: QuantizedTensor) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(t.raw.numpy(), Q[t.qtype]).copy())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_unpacked_blocks_are_ggufs_values_bit_for_bit(qtype: Q) -> None:
    t = quantized(qtype, 48, 96)
    ours, theirs = t.dequantize(), reference(t)
    assert ours.dtype == torch.float32
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_packed_layout_gives_the_values_back(qtype: Q) -> None:
    """The kernel's float32 path on the identity reads every packed weight out."""
    t = quantized(qtype, 80, 64, seed=1)
    packed, scales_zeros, wide = pack_int4([t])
    eye = torch.eye(64).repeat(1, 2 if wide else 1)  # the wide form reads [x, x]
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, 32, scales_zeros)
    torch.testing.assert_close(out.T, reference(t), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_quantized_linear_matches_the_dequantized_matmul(qtype: Q) -> None:
    """Fused parts (as q/k/v): the second part another type, so mixed forms are packed
    together (a Q4 part in the wide form when the other is 5/8-bit)."""
    parts = [quantized(qtype, 64, 96, seed=2), quantized(Q.Q4_1, 32, 96, seed=3)]
    linear = QuantizedLinear(96, 96, num_parts=2)
    for i, part in enumerate(parts):
        linear.load_part(i, part)
    x = torch.randn(5, 96)
    expected = F.linear(x, torch.cat([reference(p) for p in parts]))
    out = linear(x)
    assert out.dtype == torch.float32 and out.shape == (5, 96)
    error = (out - expected).norm() / expected.norm()
    assert error < BF16_RTOL, error


@pytest.mark.parametrize("chunk_rows", [64, 128, 4096])
def test_fused_parts_of_any_rows_pack_in_chunks(chunk_rows: int) -> None:
    """Parts of 80, 32 and 56 rows (none a multiple of the kernel's 64-row block, the
    total not of 16) packed together, a chunk at a time as the vocabulary head is:
    the packed weight is the parts' values stacked, and the padding rows are cut."""
    parts = [
        quantized(Q.Q8_0, 80, 64, 4),
        quantized(Q.Q4_1, 32, 64, 5),
        quantized(Q.Q8_0, 56, 64, 6),
    ]
    packed, scales_zeros, wide = pack_int4(parts, chunk_rows=chunk_rows)
    assert wide
    eye = torch.eye(64).repeat(1, 2)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, 32, scales_zeros)
    expected = torch.cat([reference(p) for p in parts])
    torch.testing.assert_close(out.T[:168], expected, rtol=1e-6, atol=1e-7)
    assert not out.T[168:].any()
    linear = QuantizedLinear(64, 168, num_parts=3)
    for i, part in enumerate(parts):
        linear.load_part(i, part)
    assert linear(torch.randn(2, 64)).shape == (2, 168)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_embedding_rows_are_dequantized_exactly(qtype: Q) -> None:
    t = quantized(qtype, 40, 64, seed=5)
    emb = QuantizedEmbedding(40, 64, torch.float32)
    emb.load_part(0, t)
    ids = torch.tensor([[3, 0], [39, 3]])
    assert torch.equal(emb(ids), reference(t)[ids])


def test_bad_blocks_are_named() -> None:
    raw = torch.zeros(4, 33, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"Q8_0 data of shape \(4, 33\) does not hold a 4x32"):
        QuantizedTensor("Q8_0", raw, (4, 32))
    with pytest.raises(ValueError, match="Q4_K blocks are not supported"):
        QuantizedTensor("Q4_K", raw, (4, 32))


def _runner(path: Path, cache: Path, quantization: str) -> TorchModelRunner:
    model_dir = prepare_model_dir(path, cache, tokenizer=False)
    return TorchModelRunner.from_model_dir(
        model_dir, num_blocks=16, device="cpu", dtype="float32", quantization=quantization
    )


def _greedy(runner: TorchModelRunner, prompt: list[int], steps: int) -> list[int]:
    """`steps` greedy tokens after `prompt`, one decode step each."""
    greedy = SamplingParams(temperature=0.0)
    table = list(range(16))
    out = runner.execute(ScheduledBatch([ScheduledSeq("r", prompt, 0, table, True, greedy)]))
    tokens = [int(out[0] or 0)]
    for i in range(steps - 1):
        pos = len(prompt) + i
        seq = ScheduledSeq("r", [tokens[-1]], pos, table, True, greedy, i + 1)
        tokens.append(int(runner.execute(ScheduledBatch([seq]))[0] or 0))
    return tokens


def _logits(runner: TorchModelRunner, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of `tokens` (one prefill)."""
    greedy = SamplingParams(temperature=0.0)
    rows = []
    for end in range(1, len(tokens) + 1):
        seq = ScheduledSeq("t", tokens[:end], 0, list(range(16)), True, greedy)
        rows.append(runner.compute_logits(ScheduledBatch([seq]))[0])
    return torch.stack(rows)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_tiny_model_keeps_the_float32_greedy_tokens(
    tiny_model_dir: Path, tmp_path: Path, qtype: Q
) -> None:
    """Every projection and the head packed; along the float32 path's greedy tokens
    the packed path picks the same token at every position whose float32 top-two
    margin is over MARGIN logits (below that a bfloat16 rounding may flip a tie)."""
    margin = 0.05
    path = write_gguf(tiny_model_dir, tmp_path / "m.gguf", qtype)
    dense, packed = _runner(path, tmp_path, "none"), _runner(path, tmp_path, "gguf")
    assert isinstance(packed.model.lm_head, QuantizedLinear)
    assert isinstance(
        packed.model.get_submodule("model.layers.0.mlp.gate_up_proj"), QuantizedLinear
    )
    assert not any(isinstance(m, QuantizedLinear) for m in dense.model.modules())
    checked = 0
    for prompt in ([5, 17, 99, 3], [200, 201, 202], [42] * 6):
        tokens = prompt + _greedy(dense, prompt, 10)
        ours, theirs = _logits(packed, tokens), _logits(dense, tokens)
        top2 = theirs.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > margin
        assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])
        checked += int(clear.sum())
    assert checked >= 20


def test_quantization_flag_is_checked(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown quantization 'awq'"):
        TorchModelRunner.from_model_dir(tiny_model_dir, num_blocks=4, quantization="awq")
    with pytest.raises(ValueError, match="--quantization gguf needs a GGUF checkpoint"):
        TorchModelRunner.from_model_dir(tiny_model_dir, num_blocks=4, quantization="gguf")


def test_omp_num_threads_sets_the_cpu_threads(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deployment's OMP_NUM_THREADS wins over the hidden-size default (1 here); the
    model loads on one thread, and the thread that runs the steps gets the team."""
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    try:
        runner = TorchModelRunner.from_model_dir(tiny_model_dir, num_blocks=4, device="cpu")
        assert runner.cpu_threads == min(2, os.cpu_count() or 1)
        assert torch.get_num_threads() == 1  # loading made no thread team
        seen: list[int] = []

        def step() -> None:
            greedy = SamplingParams(temperature=0.0)
            runner.execute(ScheduledBatch([ScheduledSeq("r", [5, 6], 0, [0], True, greedy)]))
            seen.append(torch.get_num_threads())

        worker = threading.Thread(target=step)
        worker.start()
        worker.join()
        assert seen == [runner.cpu_threads]
        monkeypatch.delenv("OMP_NUM_THREADS")
        runner = TorchModelRunner.from_model_dir(tiny_model_dir, num_blocks=4, device="cpu")
        assert runner.cpu_threads == 1
    finally:
        torch.set_num_threads(before)


def test_lora_on_quantized_projections_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    from infergate.engine.lora.layers import wrap_model

    packed = _runner(write_gguf(tiny_model_dir, tmp_path / "m.gguf", Q.Q4_0), tmp_path, "gguf")
    with pytest.raises(ValueError, match="serve a GGUF with --quantization none for LoRA"):
        wrap_model(packed.model, num_slots=2, max_rank=8)


def test_head_refines_its_top_logits_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Beyond `EXACT_ROWS` rows the packed head's bfloat16 outputs make near candidates
    equal; each row's top 8 logits are recomputed in float32 from the GGUF values, as the
    float32 path's head computes them, so a greedy choice between them is float32's."""
    packed = _runner(write_gguf(tiny_model_dir, tmp_path / "m.gguf", Q.Q8_0), tmp_path, "gguf")
    head = packed.model.lm_head
    assert isinstance(head, QuantizedLinear) and head.blocks is not None
    hidden = torch.randn(
        EXACT_ROWS + 2, head.in_features, generator=torch.Generator().manual_seed(0)
    )
    hidden *= 4
    logits = packed.model.compute_logits(hidden)
    exact = F.linear(hidden, head.blocks.dequantize())
    top = head(hidden).topk(8, dim=-1).indices  # the candidates the kernel's output ranks
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    assert logits.dtype == torch.float32


@pytest.mark.skipif(cpu_decode.load() is None, reason="no C compiler to build the kernels")
def test_a_q8_0_head_gives_every_logit_exactly_at_decode_batches(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Up to `EXACT_ROWS` rows a Q8_0 head reads its GGUF blocks directly
    (`cpu_decode.q8_0_matmul`): every logit is the dequantized weights' float32 dot
    product, not only the top 8."""
    packed = _runner(write_gguf(tiny_model_dir, tmp_path / "m.gguf", Q.Q8_0), tmp_path, "gguf")
    head = packed.model.lm_head
    assert isinstance(head, QuantizedLinear) and head.blocks is not None
    assert EXACT_ROWS >= 1
    hidden = torch.randn(EXACT_ROWS, head.in_features, generator=torch.Generator().manual_seed(1))
    for rows in (1, EXACT_ROWS):
        exact = F.linear(hidden[:rows], head.blocks.dequantize())
        torch.testing.assert_close(
            packed.model.compute_logits(hidden[:rows]), exact, rtol=1e-5, atol=1e-5
        )


@pytest.mark.skipif(cpu_decode.load() is None, reason="no C compiler to build the kernels")
def test_q8_0_kernel_is_the_dequantized_matmul() -> None:
    """gguf's own Q8_0 blocks (scales of every magnitude, subnormal halves included) at
    1-3 rows, against the float32 matmul of gguf's dequantized values."""
    t = quantized(Q.Q8_0, 70, 160, seed=4)
    raw = t.raw.clone()
    raw[0, 0:2] = torch.tensor([1, 0], dtype=torch.uint8)  # a subnormal half scale (2^-24)
    raw[1, 34:36] = torch.tensor([0, 0xBC], dtype=torch.uint8)  # -1.0
    t = QuantizedTensor("Q8_0", raw, t.shape)
    kernels = cpu_decode.load()
    assert kernels is not None
    for rows in (1, 3):
        x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
        expected = F.linear(x, reference(t))
        torch.testing.assert_close(
            kernels.q8_0_matmul(t.raw, 160, x), expected, rtol=1e-5, atol=1e-6
        )
    with pytest.raises(ValueError, match=r"do not hold 96 columns"):
        kernels.q8_0_matmul(t.raw, 96, torch.zeros(1, 96))
    with pytest.raises(ValueError, match=r"need \[M, 160\]"):
        kernels.q8_0_matmul(t.raw, 160, torch.zeros(1, 150))
