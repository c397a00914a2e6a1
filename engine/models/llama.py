"""Llama-family decoder (Llama 2/3): GQA, RoPE (with Llama-3 scaling), RMSNorm, SwiGLU.

Tokens of a step arrive packed flat ([T] ids, [T] positions) across sequences; attention
goes through an `AttentionContext` so the paged-cache backend is swappable. q/k/v and
gate/up projections are fused; `load_weights` maps Hugging Face's separate tensors in.
Qwen3 dense is this model with per-head q/k RMSNorm (see qwen3.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..attention.base import AttentionContext
from . import fused_decode
from .config import ModelConfig
from .layers import RMSNorm, RotaryEmbedding, SwiGLU
from .quantized import QuantizedEmbedding, QuantizedLinear, QuantizedTensor, packable

#: Checkpoint tensor types by Hugging Face name: (type name, shape rows-first).
TensorTypes = Mapping[str, tuple[str, tuple[int, ...]]]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding, qk_norm: bool) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.rope = rope
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        qkv = self.qkv_proj.forward(x)
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qkv[:, : self.q_size].view(-1, self.num_heads, self.head_dim))
            k = self.k_norm(
                qkv[:, self.q_size : qk_size].view(-1, self.num_kv_heads, self.head_dim)
            )
            q, k = self.rope(positions, q, k)
        else:  # q and k are side by side: one rotation for both
            qk = qkv[:, :qk_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = self.rope.rotate(positions, qk)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        o = ctx.attend(self.layer, q, k, v, self.scale)
        return self.o_proj.forward(o.reshape(-1, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: RotaryEmbedding, qk_norm: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, rope, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(
        self, positions: torch.Tensor, h: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        h = h + self.self_attn.forward(positions, self.input_layernorm.forward(h), ctx)
        return h + self.mlp.forward(self.post_attention_layernorm.forward(h))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool) -> None:
        super().__init__()
        # One table shared by every layer (it is not a parameter).
        self.rope = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.rope, qk_norm) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # fused_decode's per-layer plan (None: decode steps take the torch ops), for the
        # projections whose first module has the id `fused_checked` (LoRA may swap them).
        self.fused_plan: Any = None
        self.fused_checked: int | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if fused_decode.applies(self, h, ctx):
            return fused_decode.decode(self, h, ctx)
        for layer in self.layers:
            h = layer.forward(positions, h, ctx)
        return self.norm.forward(h)


# Hugging Face tensor name fragment → (our fused parameter, shard index).
_FUSED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    qk_norm = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, qk_norm=self.qk_norm)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] for the packed step."""
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.lm_head, QuantizedLinear):
            return self.lm_head.logits(hidden)
        return self.lm_head(hidden)

    def prepare_buffers(self, device: torch.device) -> None:
        """Build non-parameter state (the RoPE table) on the device the weights live on."""
        self.model.rope.build(device)

    def quantize_modules(self, types: TensorTypes) -> dict[str, str]:
        """Swap in :class:`QuantizedLinear` / :class:`QuantizedEmbedding` (on the meta
        device, before weights exist) wherever every checkpoint tensor a module fuses is
        of a packable quantized type; returns the modules left dense, with why."""
        dense: dict[str, str] = {}
        embed = "model.embed_tokens.weight"
        for path, names in self._projection_sources().items():
            parts = [types.get(n, ("absent", (0,))) for n in names]
            shapes = [(t, (s[0], s[-1])) for t, s in parts]
            module = self.get_submodule(path)
            why = packable(shapes) or ("has a bias" if module.bias is not None else None)
            if why is not None:
                dense[path] = why
                continue
            # gate/up's product stays bfloat16 into down (the kernel's input dtype).
            out = torch.bfloat16 if path.endswith("gate_up_proj") else module.weight.dtype
            quantized = QuantizedLinear(
                module.in_features, module.out_features, len(names), out, path == "lm_head"
            )
            self.set_submodule(path, quantized)
        emb = self.model.embed_tokens
        tied_dense = self.config.tie_word_embeddings and "lm_head" in dense
        if embed in types and packable([(types[embed][0], (16, 32))]) is None and not tied_dense:
            rows, cols = emb.weight.shape
            quantized_emb = QuantizedEmbedding(rows, cols, emb.weight.dtype)
            self.set_submodule("model.embed_tokens", quantized_emb)
        else:
            dense["model.embed_tokens"] = (
                "tied to a dense lm_head" if tied_dense else "not packable"
            )
        return dense

    def _projection_sources(self) -> dict[str, list[str]]:
        """Each projection module's path → the checkpoint tensors it is made of."""
        sources = {}
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            sources[p + "self_attn.qkv_proj"] = [
                f"{p}self_attn.{x}_proj.weight" for x in ("q", "k", "v")
            ]
            sources[p + "self_attn.o_proj"] = [f"{p}self_attn.o_proj.weight"]
            sources[p + "mlp.gate_up_proj"] = [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]
            sources[p + "mlp.down_proj"] = [f"{p}mlp.down_proj.weight"]
        tied = self.config.tie_word_embeddings
        sources["lm_head"] = ["model.embed_tokens.weight" if tied else "lm_head.weight"]
        return sources

    def _quantized_targets(
        self, name: str, modules: Mapping[str, nn.Module]
    ) -> list[QuantizedLinear | QuantizedEmbedding]:
        """The quantized modules checkpoint tensor `name` (our fused name) goes into: its
        own module, and the lm_head too when tied to the embeddings."""
        owners: list[nn.Module] = []
        path = name.removesuffix(".weight")
        if path != name and path in modules:
            owners.append(modules[path])
        if name == "model.embed_tokens.weight" and self.config.tie_word_embeddings:
            owners.append(self.lm_head)
        return [m for m in owners if isinstance(m, QuantizedLinear | QuantizedEmbedding)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        """Copy Hugging Face-named tensors in (quantized ones into quantized modules, or
        dequantized); missing or unknown names are errors."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        unknown: list[str] = []
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue  # some checkpoints persist this; we compute it
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            name, shard = hf_name, None
            for frag, (fused, idx) in _FUSED.items():
                if frag in hf_name:
                    name, shard = hf_name.replace(frag, fused), idx
                    break
            targets = self._quantized_targets(name, modules)
            if targets and not isinstance(tensor, QuantizedTensor):
                raise ValueError(f"weight {hf_name} is not quantized but its module is")
            if targets and isinstance(tensor, QuantizedTensor):
                for module in targets:
                    module.load_part(shard or 0, tensor)
                continue
            if isinstance(tensor, QuantizedTensor):
                tensor = tensor.dequantize()
            param = params.get(name)
            if param is None:
                unknown.append(hf_name)
                continue
            dst = param.data if shard is None else self._shard(name, param.data, shard)
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"weight {hf_name}: checkpoint shape {tuple(tensor.shape)} does not "
                    f"match the model's {tuple(dst.shape)} (config.json mismatch?)"
                )
            dst.copy_(tensor)
            loaded.add(name if shard is None else f"{name}#{shard}")
        if unknown:
            raise ValueError(f"checkpoint has tensors this model does not use: {unknown[:5]}")
        missing = [n for n in self._expected_names() if n not in loaded]
        missing += [
            f"{path}.weight"
            for path, m in self.named_modules()
            if isinstance(m, QuantizedLinear | QuantizedEmbedding) and not m.complete
        ]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}")

    def _shard(self, name: str, data: torch.Tensor, idx: int) -> torch.Tensor:
        if ".qkv_proj." in name:
            c = self.config
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            offsets = [(0, q), (q, kv), (q + kv, kv)]
        else:
            i = self.config.intermediate_size
            offsets = [(0, i), (i, i)]
        start, size = offsets[idx]
        return data.narrow(0, start, size)

    def _expected_names(self) -> list[str]:
        names = []
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name:
                names += [f"{name}#{i}" for i in range(3)]
            elif ".gate_up_proj." in name:
                names += [f"{name}#{i}" for i in range(2)]
            else:
                names.append(name)
        return names
