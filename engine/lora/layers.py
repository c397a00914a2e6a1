"""Batched LoRA over the model's fused projections (the Punica / S-LoRA technique).

Every adaptable projection of the base model is wrapped in :class:`LoRALinear`, which
holds the weights of all ``S`` resident adapter slots stacked in two matrices, and a
step carries one slot index per token (``-1``: the base model). For a projection fusing
``n`` sub-projections (q/k/v, gate/up) with slot ranks padded to ``R``:

* ``A_all: [S·n·R, in]`` — slot ``s``, sub-projection ``j`` occupies rows
  ``(s·n + j)·R …`` with that module's ``A`` (zero rows beyond its rank, or when the
  adapter does not target the module);
* ``B_all: [S·n·R, out]`` — the same rows hold ``Bᵀ`` of sub-projection ``j`` in the
  output columns of its slice (the scale ``alpha / r`` already folded in).

For the packed tokens ``X: [T, in]`` and slot indices ``σ: [T]``:

    shrink = X · A_allᵀ                       [T, S·n·R]   (one matmul)
    shrink[t, rows of slot s] = 0  for s ≠ σ_t  (a one-hot mask: a gather, as BGMV)
    Y = W X + shrink · B_all                  [T, out]     (one matmul)

so ``Y_t = W x_t + Σ_j B_{σ_t, j} A_{σ_t, j} x_t`` exactly, for any mix of adapters and
base-model tokens in the batch, with no loop over requests. The cost is ``T·S·n·R·(in +
out)`` multiply-adds, small next to ``W`` while ``S·R ≪ in``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..models import LlamaForCausalLM
from .adapter import LoRAAdapter


@dataclass
class LoRAStepState:
    """Per-step input shared by every wrapped projection: the token → slot indices."""

    token_slots: torch.Tensor | None = None  # [T] int64, -1 = no adapter; None = no LoRA


class LoRALinear(nn.Module):
    """``base(x) + Σ`` of the resident adapters' low-rank deltas, selected per token."""

    def __init__(
        self,
        base: nn.Linear,
        slices: list[tuple[str, int, int]],
        state: LoRAStepState,
        num_slots: int,
        max_rank: int,
    ) -> None:
        super().__init__()
        self.base = base
        self.slices = slices  # (module name, first output column, width)
        self.state = state
        self.num_slots = num_slots
        self.max_rank = max_rank
        n, w = len(slices), base.weight
        rows = num_slots * n * max_rank
        self.register_buffer(
            "lora_a", torch.zeros(rows, w.shape[1], dtype=w.dtype, device=w.device)
        )
        self.register_buffer(
            "lora_b", torch.zeros(rows, w.shape[0], dtype=w.dtype, device=w.device)
        )
        self.lora_a: torch.Tensor
        self.lora_b: torch.Tensor

    def _rows(self, slot: int, j: int) -> slice:
        start = (slot * len(self.slices) + j) * self.max_rank
        return slice(start, start + self.max_rank)

    def set_slot(self, slot: int, adapter: LoRAAdapter | None, layer: int) -> None:
        """Write ``adapter``'s weights for this layer into ``slot`` (None: clear it)."""
        for j, (module, col, width) in enumerate(self.slices):
            rows = self._rows(slot, j)
            self.lora_a[rows].zero_()
            self.lora_b[rows].zero_()
            pair = adapter.weights.get((layer, module)) if adapter is not None else None
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            start = rows.start
            self.lora_a[start : start + r].copy_(a)
            self.lora_b[start : start + r, col : col + width].copy_(b.T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        slots = self.state.token_slots
        if slots is None:
            return y
        t, per_slot = x.shape[0], len(self.slices) * self.max_rank
        shrink = (x @ self.lora_a.T).view(t, self.num_slots, per_slot)
        onehot = torch.zeros(t, self.num_slots + 1, dtype=x.dtype, device=x.device)
        # Column S (index -1 wraps to it) is the "no adapter" slot, dropped below.
        onehot.scatter_(1, (slots % (self.num_slots + 1)).unsqueeze(1), 1.0)
        masked = shrink * onehot[:, : self.num_slots, None]
        return y + masked.view(t, -1) @ self.lora_b


def wrap_model(
    model: LlamaForCausalLM, num_slots: int, max_rank: int
) -> tuple[LoRAStepState, list[tuple[int, LoRALinear]]]:
    """Replace the Llama/Qwen3 projections of ``model`` by :class:`LoRALinear` in place.

    Returns the shared step state and ``(layer, wrapper)`` pairs for loading slots.
    """
    state = LoRAStepState()
    wrapped: list[tuple[int, LoRALinear]] = []
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter, hidden = cfg.intermediate_size, cfg.hidden_size
    layout = {
        ("self_attn", "qkv_proj"): [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)],
        ("self_attn", "o_proj"): [("o_proj", 0, hidden)],
        ("mlp", "gate_up_proj"): [("gate_proj", 0, inter), ("up_proj", inter, inter)],
        ("mlp", "down_proj"): [("down_proj", 0, hidden)],
    }
    for i, layer in enumerate(model.model.layers):
        for (parent_name, attr), slices in layout.items():
            parent = getattr(layer, parent_name)
            base = getattr(parent, attr)
            if not isinstance(base, nn.Linear):  # e.g. GGUF blocks kept quantized
                raise ValueError(
                    f"LoRA adapts dense projections, and layer {i}'s {attr} is a "
                    f"{type(base).__name__}: serve a GGUF with --quantization none for LoRA"
                )
            lin = LoRALinear(base, slices, state, num_slots, max_rank)
            setattr(parent, attr, lin)
            wrapped.append((i, lin))
    return state, wrapped


def projection_shapes(model: LlamaForCausalLM) -> dict[str, tuple[int, int]]:
    """``module → (in_features, out_features)`` of each adaptable projection (HF names)."""
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }  # fmt: skip
