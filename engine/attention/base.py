"""The attention-backend seam: backend-neutral step metadata and the backend protocol.

KV cache layout (one tensor per layer), chosen to match FlashInfer's paged "NHD" layout
so a FlashInfer backend can use the same tensors without copies:

    kv_cache[layer]: [num_blocks, 2, block_size, num_kv_heads, head_dim]
                                  ^ 0 = keys, 1 = values

Token at position `p` of a sequence lives in block `block_table[p // block_size]`, slot
`p % block_size`; its flat "slot" is `block_id * block_size + p % block_size`.

A step's tokens are packed flat: sequence `i` owns rows `query_start_loc[i] :
query_start_loc[i+1]`, computed at positions `context_lens[i] .. seq_lens[i]-1`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int]:
    return (num_blocks, 2, block_size, num_kv_heads, head_dim)


@dataclass
class AttentionMetadata:
    """Everything a backend needs for one step, independent of the backend.

    Tensors live on the model's device; the `*_list` twins are host copies so a backend
    can plan without device→host syncs.
    """

    num_tokens: int
    block_size: int
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot each new token's K/V goes to
    query_start_loc: torch.Tensor  # [S+1] int32, prefix sums of query lengths
    seq_lens: torch.Tensor  # [S] int32, tokens in KV after this step (context + new)
    context_lens: torch.Tensor  # [S] int32, tokens already in KV before this step
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    query_lens_list: list[int]
    seq_lens_list: list[int]
    context_lens_list: list[int]
    block_tables_list: list[list[int]]
    backend_state: Any = None  # filled by AttentionBackend.prepare

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_list)


def build_metadata(
    *,
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Derive positions, slots and padded tables from per-sequence (len, start, blocks)."""
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    seq_lens = []
    for n, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
        end = ctx + n
        for p in range(ctx, end):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        starts.append(starts[-1] + n)
        seq_lens.append(end)
    width = max((len(t) for t in block_tables), default=0) or 1
    padded = [t + [0] * (width - len(t)) for t in block_tables]

    def i64(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64).to(device, non_blocking=True)

    def i32(x: Any) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32).to(device, non_blocking=True)

    return AttentionMetadata(
        num_tokens=len(positions),
        block_size=block_size,
        positions=i64(positions),
        slot_mapping=i64(slots),
        query_start_loc=i32(starts),
        seq_lens=i32(seq_lens),
        context_lens=i32(context_lens),
        block_tables=i32(padded),
        query_lens_list=list(query_lens),
        seq_lens_list=seq_lens,
        context_lens_list=list(context_lens),
        block_tables_list=[list(t) for t in block_tables],
    )


class AttentionBackend(Protocol):
    """Computes causal attention of new tokens over the paged KV cache.

    `prepare` runs once per step (FlashInfer plans its kernels there); `forward` runs per
    layer: it stores the new tokens' K/V into `kv_cache` at `meta.slot_mapping`, then
    attends each new query to every cached position up to and including its own.
    """

    name: str

    def prepare(self, meta: AttentionMetadata) -> None: ...

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # see module docstring
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...


@dataclass
class AttentionContext:
    """What a model's attention layers need for one forward: backend, metadata, caches."""

    backend: AttentionBackend
    meta: AttentionMetadata
    kv_caches: list[torch.Tensor]

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return self.backend.forward(q, k, v, self.kv_caches[layer], self.meta, scale)
