"""Building blocks shared by the decoder models: RMSNorm, rotary embedding, SwiGLU MLP."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as the reference implementation does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel: one op instead of six (a decode step runs 61 norms).
        shape = (x.shape[-1],)
        if x.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair rotation frequencies, with Llama-3 or linear scaling when configured.

    Llama 3 leaves high frequencies (short wavelengths) alone, divides low ones by
    `factor`, and blends linearly in between, so long-context extension does not disturb
    local position information.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if not scaling:
        return inv_freq
    kind = scaling["rope_type"]
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r}")
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    orig = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    # 0 where the wavelength is long (scale fully), 1 where short (keep), ramp between.
    keep = ((orig / wavelen) - low) / (high - low)
    keep = keep.clamp(0.0, 1.0)
    return keep * inv_freq + (1.0 - keep) * inv_freq / factor


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE over a cos/sin table indexed by absolute position."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self._table: torch.Tensor | None = None  # [max_positions, head_dim] cos ‖ sin, fp32
        # The step's (positions, cos ‖ cos, −sin ‖ sin): every layer rotates at the same
        # positions, so the table is gathered once per step. Holding `positions` keeps
        # its identity from being reused by another tensor.
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def build(self, device: torch.device) -> None:
        """(Re)compute the cos/sin table on `device`; called after weights are placed."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        pos = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(pos, inv_freq)
        self._table = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)

    def table_on(self, device: torch.device) -> torch.Tensor:
        """The cos ‖ sin table [max_positions, head_dim] (float32) on `device`, built on
        first use there."""
        if self._table is None or self._table.device != device:
            self.build(device)
        assert self._table is not None
        return self._table

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D], positions: [T] → rotated q, k."""
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D] (any heads: q and k side by side too) rotated at `positions`:
        ``x·cos + rotate_half(x)·sin``, three ops."""
        cos, sin = self._cos_sin(positions, x)
        half = self.head_dim // 2
        swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
        return torch.addcmul(x * cos, swapped, sin)

    def _cos_sin(
        self, positions: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        step = self._step
        if step is not None and step[0] is positions and step[1].dtype == x.dtype:
            return step[1], step[2]
        half = self.head_dim // 2
        cs = self.table_on(x.device)[positions]
        cos, sin = cs[:, None, :half], cs[:, None, half:]
        cos2 = torch.cat([cos, cos], dim=-1).to(x.dtype)
        sin2 = torch.cat([-sin, sin], dim=-1).to(x.dtype)
        self._step = (positions, cos2, sin2)
        return cos2, sin2


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).split(self.intermediate, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)
