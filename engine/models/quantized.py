"""Weights kept in GGUF's block quantization, multiplied without dequantizing them.

A GGUF quantized tensor is rows of blocks of 32 values, each block an integer code per
value and a float16 scale (plus a float16 minimum for the ``_1`` types): ``value = code ×
scale (+ minimum)``. Dequantizing to float32 at load makes a 4-bit model 8x larger and
every decode step stream all of it, so here the blocks become torch's CPU weight-only
int4 layout instead (``aten._convert_weight_to_int4pack_for_cpu``), read directly by its
``_weight_int4pack_mm_for_cpu`` kernel. That kernel computes ``(nibble − 8) × scale +
zero`` per group of 32 along K, which expresses each type exactly:

* Q4_0 (``code − 8``) and Q4_1 (``code, + minimum``): one nibble per value, ``zero`` =
  ``minimum + 8 × scale`` for Q4_1;
* Q8_0, Q5_0, Q5_1 (codes of 8 and 5 bits): "wide" — ``code = 16 × hi + lo`` splits
  each row into two 4-bit halves, ``hi`` groups with scale ``16 × scale`` and ``lo``
  groups with ``zero = minimum + 8 × scale``; the input is fed twice (``[x, x]``), so
  one kernel call sums both halves. Same bytes as int8.

The kernel's fast path takes bfloat16 activations and bfloat16 scales (its float32 path
is scalar, 30x slower), so a quantized linear rounds its input, scales and output to
bfloat16 (8 bits of mantissa; llama.cpp rounds activations to 8-bit integers for these
types). Embedding rows are gathered from the stored blocks and dequantized exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..kernels import cpu_decode

GROUP = 32  # values per GGUF block of these types, and the kernel's group size
#: Bytes of one block, by type.
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
#: Types whose codes span 16 values (one nibble); the others need the wide form.
NARROW = {"Q4_0": -8, "Q4_1": 0}  # type → smallest code
PACKABLE = tuple(BLOCK_BYTES)
#: Up to this many rows a Q8_0 lm_head takes `QuantizedLinear.logits`' exact kernel;
#: beyond, the int4 kernel's batched matmul is faster (8 rows: 7.6 against 9.7 ms).
EXACT_ROWS = 4
_PACK_ROWS = 4096  # rows packed at a time (a multiple of the kernel's 64-row block)
_INNER_K_TILES = 2


@dataclass(frozen=True)
class QuantizedTensor:
    """One GGUF tensor as stored: ``raw`` [rows, row bytes] uint8 blocks of ``qtype``,
    holding a ``shape`` = (rows, columns) matrix."""

    qtype: str
    raw: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"{self.qtype} blocks are not supported (supported: {PACKABLE})")
        rows, cols = self.shape
        if cols % GROUP or self.raw.shape != (rows, cols // GROUP * BLOCK_BYTES[self.qtype]):
            raise ValueError(
                f"{self.qtype} data of shape {tuple(self.raw.shape)} does not hold a "
                f"{rows}x{cols} matrix"
            )

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes int16 [rows, cols], scale float32 [rows, cols/32], minimum or None)."""
        return unpack_blocks(self.raw, self.qtype)

    def dequantize(self) -> torch.Tensor:
        """float32 values, bit-identical to ``gguf.quants.dequantize``."""
        return dequantize_blocks(self.raw, self.qtype)


def unpack_blocks(
    raw: torch.Tensor, qtype: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Split rows of GGUF blocks into integer codes, per-block scales and minimums.

    In every type the 16 bytes of nibbles hold values 0..15 of the block in their low
    halves and 16..31 in their high halves; Q5's fifth bits are a little-endian uint32.
    """
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, BLOCK_BYTES[qtype])

    def half(start: int) -> torch.Tensor:
        return blocks[..., start : start + 2].contiguous().view(torch.float16).float()

    scale = half(0)
    minimum = half(2) if qtype in ("Q4_1", "Q5_1") else None
    if qtype == "Q8_0":
        codes = blocks[..., 2:].contiguous().view(torch.int8).to(torch.int16)
    else:
        qs = blocks[..., -16:].to(torch.int16)
        codes = torch.cat([qs & 15, qs >> 4], dim=-1)
        if qtype in ("Q5_0", "Q5_1"):
            qh = blocks[..., -20:-16].to(torch.int16)
            bits = (qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.int16)) & 1
            codes = codes | (bits.reshape(codes.shape) << 4)
        codes = codes - {"Q4_0": 8, "Q5_0": 16}.get(qtype, 0)
    flat = (rows, -1)
    return (
        codes.reshape(flat),
        scale.reshape(flat),
        None if minimum is None else minimum.reshape(flat),
    )


def dequantize_blocks(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 values of rows of blocks, computed as gguf does (``scale × code + min``)."""
    codes, scale, minimum = unpack_blocks(raw, qtype)
    rows = codes.shape[0]
    values = scale.unsqueeze(-1) * codes.view(rows, -1, GROUP).float()
    if minimum is not None:
        values = values + minimum.unsqueeze(-1)
    return values.reshape(rows, -1)


def int4_groups(tensor: QuantizedTensor, wide: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(nibbles int32 [rows, K'], scale-and-zero float32 [rows, K'/32, 2]) with which the
    kernel's ``(nibble − 8) × scale + zero`` gives the tensor's values; K' is twice the
    columns in the wide form (``hi`` halves first, then ``lo``)."""
    codes, scale, minimum = tensor.codes()
    offset = torch.zeros_like(scale) if minimum is None else minimum
    if not wide:
        if tensor.qtype not in NARROW:
            raise ValueError(f"{tensor.qtype} codes do not fit one nibble")
        base = NARROW[tensor.qtype]
        zero = offset + (base + 8) * scale
        return (codes - base).int(), torch.stack([scale, zero], dim=-1)
    hi, lo = (codes >> 4) + 8, codes & 15  # codes lie in [-128, 127]
    hi_groups = torch.stack([16 * scale, torch.zeros_like(scale)], dim=-1)
    lo_groups = torch.stack([scale, offset + 8 * scale], dim=-1)
    return torch.cat([hi, lo], dim=1).int(), torch.cat([hi_groups, lo_groups], dim=1)


def pack_int4(
    parts: list[QuantizedTensor], *, chunk_rows: int = _PACK_ROWS
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(packed weight, float32 scales-and-zeros [K'/32, N, 2], wide) for the kernel,
    from `parts` stacked along the rows (a fused q/k/v or gate/up projection). The
    kernel takes the scales in its activations' dtype (bfloat16 to serve).

    Packed about `chunk_rows` rows at a time so the int32 nibbles never exist whole (a
    vocabulary head would need 226 MB of them). The kernel lays rows out in blocks of
    64 (a shorter last block its own way), so every chunk but the last is a multiple
    of 64 rows, whatever the parts' sizes.
    """
    wide = any(p.qtype not in NARROW for p in parts)
    packed: list[torch.Tensor] = []
    groups: list[torch.Tensor] = []
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    for part in parts:
        for start in range(0, part.shape[0], chunk_rows):
            rows = part.raw[start : start + chunk_rows]
            chunk = QuantizedTensor(part.qtype, rows, (rows.shape[0], part.shape[1]))
            pending.append(int4_groups(chunk, wide))
            if sum(n.shape[0] for n, _ in pending) >= chunk_rows:
                pending = _pack_pending(pending, packed, groups, final=False)
    _pack_pending(pending, packed, groups, final=True)
    scales_zeros = torch.cat(groups, dim=0).transpose(0, 1).contiguous()
    return torch.cat(packed, dim=0), scales_zeros, wide


def _pack_pending(
    pending: list[tuple[torch.Tensor, torch.Tensor]],
    packed: list[torch.Tensor],
    groups: list[torch.Tensor],
    *,
    final: bool,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pack the whole 64-row blocks of `pending` (all of it when `final`, its rows
    padded to 16 with zeros); returns the rows left over."""
    if not pending:
        return []
    nibbles = torch.cat([n for n, _ in pending])
    sz = torch.cat([g for _, g in pending])
    take = nibbles.shape[0] if final else nibbles.shape[0] // 64 * 64
    if take == 0:
        return pending
    head, head_sz = nibbles[:take], sz[:take]
    pad = -take % 16
    if pad:  # zero rows: nibble 8, scale and zero 0
        head = F.pad(head, (0, 0, 0, pad), value=8)
        head_sz = F.pad(head_sz, (0, 0, 0, 0, 0, pad))
    packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        head.contiguous(), _INNER_K_TILES))  # fmt: skip
    groups.append(head_sz)
    return [(nibbles[take:], sz[take:])] if take < nibbles.shape[0] else []


def packable(parts: list[tuple[str, tuple[int, int]]]) -> str | None:
    """Why `parts` ((type, shape) stacked along rows) cannot be one quantized linear, or
    None when they can: every part a supported type, columns equal (rows are padded
    to the kernel's multiple of 16)."""
    if any(qtype not in BLOCK_BYTES for qtype, _ in parts):
        return "a part is not " + "/".join(PACKABLE)
    if len({shape[1] for _, shape in parts}) != 1:
        return "parts differ in columns"
    return None


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, wide: bool, out: int
) -> torch.Tensor:
    """The kernel on bfloat16 rows `x` [M, in] (fed twice in the wide form): bfloat16
    [M, out], a view when the weight's rows were padded to 16."""
    if wide:
        x = torch.cat([x, x], dim=-1)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)
    return y if y.shape[-1] == out else y[:, :out]


class QuantizedLinear(nn.Module):
    """``y = x Wᵀ (+ b)`` with W in torch's CPU int4 layout (built from GGUF blocks).

    A fused projection has several parts (q, k, v): :meth:`load_part` takes each, and
    the weight is packed once the last has come.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_parts: int = 1,
        out_dtype: torch.dtype | None = None,
        keep_blocks: bool = False,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # An lm_head keeps its GGUF blocks (shared with tied embeddings) for refine_top.
        self.keep_blocks = keep_blocks
        self.blocks: QuantizedTensor | None = None
        # The output's dtype (None: the input's). bfloat16 where the next op is another
        # quantized linear (SwiGLU's gate/up → down) saves two conversions.
        self.out_dtype = out_dtype
        self.parts: list[QuantizedTensor | None] = [None] * num_parts
        self.wide = False
        self.register_buffer("packed", None)
        self.register_buffer("scales_zeros", None)
        self.packed: torch.Tensor | None
        self.scales_zeros: torch.Tensor | None

    @property
    def complete(self) -> bool:
        return self.packed is not None

    def load_part(self, index: int, tensor: QuantizedTensor) -> None:
        """Take part `index`; pack when every part is here."""
        self.parts[index] = tensor
        parts = [p for p in self.parts if p is not None]
        if len(parts) < len(self.parts):
            return
        rows = sum(p.shape[0] for p in parts)
        if rows != self.out_features or parts[0].shape[1] != self.in_features:
            raise ValueError(
                f"quantized parts make a {rows}x{parts[0].shape[1]} weight, the model "
                f"needs {self.out_features}x{self.in_features} (config.json mismatch?)"
            )
        self.packed, scales_zeros, self.wide = pack_int4(parts)
        self.scales_zeros = scales_zeros.to(torch.bfloat16)
        if self.keep_blocks and len(parts) == 1:
            self.blocks = parts[0]
        self.parts = [None] * len(self.parts)  # the blocks are not kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # dtype checks in Python: a no-op .to() still costs a dispatch, ~240 a step.
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if flat.dtype != torch.bfloat16:
            flat = flat.to(torch.bfloat16)
        y = self.matmul_bf16(flat)
        out_dtype = self.out_dtype or x.dtype
        if out_dtype != torch.bfloat16:
            y = y.to(out_dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def matmul_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ`` of bfloat16 rows [M, in] as the kernel gives it: bfloat16 [M, out]
        (a view when the rows were padded to 16)."""
        assert self.packed is not None and self.scales_zeros is not None, "not loaded"
        return int4_matmul(x, self.packed, self.scales_zeros, self.wide, self.out_features)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 ``x Wᵀ`` of an lm_head's rows `x`.

        A Q8_0 lm_head (GGUF's usual output type for small models) at up to
        `EXACT_ROWS` rows on CPU: the dequantized weights' exact dot products, reading
        the kept Q8_0 blocks once (`cpu_decode.q8_0_matmul`; SmolLM2's 30 MB in 1.3 ms
        on 2 cores, where the int4 kernel's wide form reads 35 MB and needs
        `refine_top` after it: 2.5 ms). Otherwise the int4 kernel, refined.
        """
        blocks = self.blocks
        if (
            blocks is not None and blocks.qtype == "Q8_0" and 0 < x.shape[0] <= EXACT_ROWS
            and x.device.type == "cpu" and (kernels := cpu_decode.load()) is not None
        ):  # fmt: skip
            return kernels.q8_0_matmul(blocks.raw, self.in_features, x.float().contiguous())
        return self.refine_top(x, self(x))

    def refine_top(self, x: torch.Tensor, y: torch.Tensor, k: int = 8) -> torch.Tensor:
        """`y` = self(x) as float32 with each row's `k` largest recomputed in float32 from
        the exact GGUF values (when the blocks are kept).

        For logits: the kernel's bfloat16 output steps by 0.125 around 25, so near-equal
        candidates come out equal and the lower token id wins a greedy tie; the exact
        dot products of the few candidates decide instead (a step costs k rows).
        """
        y = y.float()
        if self.blocks is None or y.shape[0] == 0:
            return y
        k = min(k, self.out_features)
        top = y.topk(k, dim=-1).indices  # [M, k]
        rows = dequantize_blocks(self.blocks.raw[top.reshape(-1)], self.blocks.qtype)
        exact = torch.bmm(rows.view(*top.shape, -1), x.float().unsqueeze(-1)).squeeze(-1)
        return y.scatter(1, top, exact)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class QuantizedEmbedding(nn.Module):
    """Token embeddings kept as GGUF blocks; the rows a step needs are dequantized
    exactly (to the model's dtype)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.qtype = ""
        self.register_buffer("raw", None)
        self.raw: torch.Tensor | None

    @property
    def complete(self) -> bool:
        return self.raw is not None

    def load_part(self, index: int, tensor: QuantizedTensor) -> None:
        if tensor.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"quantized embedding of shape {tensor.shape}, the model needs "
                f"{(self.num_embeddings, self.embedding_dim)} (config.json mismatch?)"
            )
        self.qtype, self.raw = tensor.qtype, tensor.raw

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.raw is not None, "not loaded"
        rows = dequantize_blocks(self.raw[ids.reshape(-1)], self.qtype)
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)
