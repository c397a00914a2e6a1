"""A Llama decode step on CPU with the glue between the quantized matmuls fused.

Per layer, the torch path runs ~40 small ops around its four matmuls; here it is four
kernel calls (engine/kernels/decode_cpu.c) around the same four matmuls:

    x  = rms_norm(h)                     (fused with the previous layer's residual add)
    q  = rope(q), cache ← rope(k), v     (one call: rotate, convert, store)
    o  = softmax(q·Kᵀ/√d)·V              (one call over the paged cache)
    h += o_proj(o);  x = rms_norm(h)     (one call)
    h += down(silu(gate) · up)           (one call for silu · up; the add is fused next)

It applies to decode steps (one new token per sequence) of a float32 model whose
projections are all `QuantizedLinear` (GGUF blocks on CPU), without per-head q/k norms,
over a float32 or bfloat16 cache; anything else takes the torch path. The arithmetic is
the torch path's, so the two agree to rounding (tests/engine/test_fused_decode.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from ..kernels import cpu_decode
from .quantized import QuantizedLinear

if TYPE_CHECKING:
    from ..attention.base import AttentionContext
    from .llama import DecoderLayer, DecoderModel

_CACHE_DTYPES = (torch.float32, torch.bfloat16)


def _layers(model: DecoderModel) -> list[DecoderLayer]:
    return [cast("DecoderLayer", layer) for layer in model.layers]


def _q(module: object) -> QuantizedLinear:
    """A projection `applies` found quantized."""
    return cast(QuantizedLinear, module)


def _quantized_layers(model: DecoderModel) -> bool:
    """Whether every layer is the plain quantized Llama layer this path computes."""
    for layer in _layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if attn.q_norm is not None or not all(
            isinstance(p, QuantizedLinear) and p.complete for p in projections
        ):
            return False
    return True


def applies(model: DecoderModel, h: torch.Tensor, ctx: AttentionContext) -> bool:
    """Whether this step can take the fused path (checked every step: LoRA may wrap the
    projections after loading, and prefills and decodes alternate)."""
    meta = ctx.meta
    if meta.num_tokens != meta.num_seqs or h.dtype != torch.float32 or h.device.type != "cpu":
        return False
    if ctx.kv_caches[0].dtype not in _CACHE_DTYPES:
        return False
    key = id(_layers(model)[0].self_attn.qkv_proj)
    if model.fused_checked != key:  # once per set of modules
        model.fused_ok = _quantized_layers(model)
        model.fused_checked = key
    return model.fused_ok and cpu_decode.load() is not None


def decode(model: DecoderModel, h: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
    """Final hidden states (float32 [S, hidden]) of a decode step whose embeddings are
    `h`; `applies` must have said yes."""
    kernels = cpu_decode.load()
    assert kernels is not None
    meta, rope = ctx.meta, model.rope
    if rope._table is None or rope._table.device != h.device:
        rope.build(h.device)
    assert rope._table is not None
    cache0 = ctx.kv_caches[0]
    step = cpu_decode.DecodeStep(
        positions=meta.positions, slots=meta.slot_mapping, tables=meta.block_tables,
        seq_lens=meta.seq_lens, table=rope._table, block_size=meta.block_size,
        num_blocks=cache0.shape[0],
    )  # fmt: skip
    h = h.contiguous()
    layers = _layers(model)
    first = layers[0].input_layernorm
    x = kernels.rms_norm(h, first.weight, first.eps)
    delta: torch.Tensor | None = None
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if delta is not None:
            norm = layer.input_layernorm
            x = kernels.add_rms_norm(h, delta, norm.weight, norm.eps)
        cache = ctx.kv_caches[attn.layer]
        qkv = _q(attn.qkv_proj).matmul_bf16(x).contiguous()
        q = kernels.rope_store(qkv, step, cache, attn.num_heads, attn.num_kv_heads, attn.head_dim)
        o = kernels.attention(q, cache, step, attn.num_kv_heads, attn.scale)
        norm = layer.post_attention_layernorm
        x = kernels.add_rms_norm(
            h, _q(attn.o_proj).matmul_bf16(o).contiguous(), norm.weight, norm.eps
        )
        act = kernels.silu_mul(_q(mlp.gate_up_proj).matmul_bf16(x).contiguous(), mlp.intermediate)
        delta = _q(mlp.down_proj).matmul_bf16(act).contiguous()
    if delta is not None:
        h.add_(delta)
    return model.norm.forward(h)
