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

from typing import TYPE_CHECKING, NamedTuple, cast

import torch

from ..kernels import cpu_decode
from .quantized import QuantizedLinear, int4_matmul

if TYPE_CHECKING:
    from ..attention.base import AttentionContext
    from .llama import DecoderLayer, DecoderModel

_CACHE_DTYPES = (torch.float32, torch.bfloat16)


def _layers(model: DecoderModel) -> list[DecoderLayer]:
    return [cast("DecoderLayer", layer) for layer in model.layers]


class _Matmul(NamedTuple):
    """A packed projection's kernel arguments, read once (buffers are slow attributes)."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    wide: bool
    out: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return int4_matmul(x, self.packed, self.scales_zeros, self.wide, self.out).contiguous()


def _matmul(module: object) -> _Matmul:
    q = cast(QuantizedLinear, module)
    assert q.packed is not None and q.scales_zeros is not None
    return _Matmul(q.packed, q.scales_zeros, q.wide, q.out_features)


class _Layer(NamedTuple):
    """What a fused step reads of one layer: no module attribute lookups per step."""

    qkv: _Matmul
    o: _Matmul
    gate_up: _Matmul
    down: _Matmul
    norm_in: torch.Tensor
    eps_in: float
    norm_post: torch.Tensor
    eps_post: float
    cache: int  # index of the layer's KV cache
    scale: float


class Plan(NamedTuple):
    """Every layer's `_Layer`, and the geometry they share."""

    layers: list[_Layer]
    geometry: cpu_decode.Geometry


def _norm_weight(weight: torch.Tensor, hidden: int) -> torch.Tensor | None:
    """The weight as the kernels read it (float32 [hidden], contiguous), or None."""
    w = weight.detach()
    ok = w.dtype == torch.float32 and w.is_contiguous() and w.numel() == hidden
    return w if ok and w.device.type == "cpu" else None


def _plan(model: DecoderModel) -> Plan | None:
    """The step's plan, or None when a layer is not the plain quantized Llama layer this
    path computes (or the layers differ in shape)."""
    layers, shapes = [], set()
    for layer in _layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if attn.q_norm is not None or not all(
            isinstance(p, QuantizedLinear) and p.complete for p in projections
        ):
            return None
        hidden = cast(QuantizedLinear, attn.o_proj).out_features
        inp = _norm_weight(layer.input_layernorm.weight, hidden)
        post = _norm_weight(layer.post_attention_layernorm.weight, hidden)
        if inp is None or post is None:
            return None
        shapes.add(cpu_decode.Geometry(
            hidden, attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.intermediate
        ))  # fmt: skip
        qkv, o, gate_up, down = map(_matmul, projections)
        layers.append(_Layer(
            qkv, o, gate_up, down, inp, layer.input_layernorm.eps, post,
            layer.post_attention_layernorm.eps, attn.layer, attn.scale,
        ))  # fmt: skip
    return Plan(layers, shapes.pop()) if len(shapes) == 1 else None


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
        model.fused_plan = _plan(model)
        model.fused_checked = key
    return model.fused_plan is not None and cpu_decode.load() is not None


def decode(model: DecoderModel, h: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
    """Final hidden states (float32 [S, hidden]) of a decode step whose embeddings are
    `h`; `applies` must have said yes."""
    kernels = cpu_decode.load()
    plan = cast("Plan | None", model.fused_plan)
    assert kernels is not None and plan is not None
    meta = ctx.meta
    step = cpu_decode.DecodeStep(
        positions=meta.positions, slots=meta.slot_mapping, tables=meta.block_tables,
        seq_lens=meta.seq_lens, table=model.rope.table_on(h.device),
        block_size=meta.block_size, num_blocks=ctx.kv_caches[0].shape[0],
    )  # fmt: skip
    h = h.contiguous()
    caches = [ctx.kv_caches[layer.cache] for layer in plan.layers]
    run = cpu_decode.StepKernels(kernels, step, caches, plan.geometry, h)
    first = plan.layers[0]
    x = kernels.rms_norm(h, first.norm_in, first.eps_in)
    for i, layer in enumerate(plan.layers):
        o = run.rope_attention(layer.qkv(x), i, layer.scale)
        x = run.add_rms_norm(layer.o(o), layer.norm_post, layer.eps_post)
        delta = layer.down(run.silu_mul(layer.gate_up(x)))
        if i + 1 < len(plan.layers):
            nxt = plan.layers[i + 1]
            x = run.add_rms_norm(delta, nxt.norm_in, nxt.eps_in)
        else:
            h.add_(delta)
    return model.norm.forward(h)
