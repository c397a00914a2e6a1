"""Portable attention over the paged KV cache in plain torch (CPU, and a GPU reference).

Single-token queries (decodes, and 1-token prefill chunks) are batched into one
`scaled_dot_product_attention` call over their gathered blocks with a key-length mask;
longer chunks (prefills, with or without cached prefix) run one call each with a causal
mask offset by the cached context. Per-step planning happens once in `prepare`. A cache
kept in a narrower dtype than the queries (``--kv-cache-dtype bfloat16`` under a float32
model) is widened as it is gathered: only the storage is rounded, attention runs in the
queries' dtype (in the copy that splitting keys from values makes anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .base import AttentionMetadata


@dataclass
class _Chunk:
    rows: slice  # this sequence's rows in the packed step
    blocks: torch.Tensor  # [nb] block ids covering [0, seq_len)
    seq_len: int
    mask: torch.Tensor | None  # [n, seq_len] bool, None when plain causal (no context)


@dataclass
class _Plan:
    key_rows: torch.Tensor  # [T] row of each new token's key in the cache viewed as
    value_rows: torch.Tensor  # [num_blocks * 2 * block_size, Hkv, D]; value likewise
    single_rows: torch.Tensor | None  # [Sd] rows of 1-token queries
    single_tables: torch.Tensor | None  # [Sd, W] their block tables (trimmed)
    single_mask: torch.Tensor | None  # [Sd, 1, 1, W*block_size] valid keys
    chunks: list[_Chunk]
    all_single: bool = False  # every row a 1-token query (a pure decode step)


class TorchAttentionBackend:
    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        dev = meta.positions.device
        bs = meta.block_size
        single: list[int] = []
        chunks: list[_Chunk] = []
        start = 0
        for i, n in enumerate(meta.query_lens_list):
            seq_len = meta.seq_lens_list[i]
            ctx = meta.context_lens_list[i]
            if n == 1:
                single.append(i)
            elif n > 1:
                nb = -(-seq_len // bs)
                blocks = meta.block_tables[i, :nb].long()
                mask = None
                if ctx > 0:
                    q_pos = torch.arange(ctx, seq_len, device=dev)[:, None]
                    mask = torch.arange(seq_len, device=dev)[None, :] <= q_pos
                chunks.append(_Chunk(slice(start, start + n), blocks, seq_len, mask))
            start += n
        rows = tables = mask = None
        if single:
            idx = torch.tensor(single, dtype=torch.int64, device=dev)
            rows = meta.query_start_loc[:-1].long()[idx]
            width = -(-max(meta.seq_lens_list[i] for i in single) // bs)
            tables = meta.block_tables[idx, :width].long()
            key_pos = torch.arange(width * bs, device=dev)
            mask = (key_pos[None, :] < meta.seq_lens[idx].long()[:, None])[:, None, None, :]
        key_rows = (meta.slot_mapping // bs) * (2 * bs) + meta.slot_mapping % bs
        meta.backend_state = _Plan(
            key_rows=key_rows,
            value_rows=key_rows + bs,
            single_rows=rows,
            single_tables=tables,
            single_mask=mask,
            chunks=chunks,
            all_single=len(single) == len(meta.query_lens_list),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        plan = meta.backend_state
        if not isinstance(plan, _Plan):
            raise RuntimeError("TorchAttentionBackend.prepare was not called for this step")
        rows = kv_cache.view(-1, *kv_cache.shape[-2:])
        rows.index_copy_(0, plan.key_rows, k.to(kv_cache.dtype))
        rows.index_copy_(0, plan.value_rows, v.to(kv_cache.dtype))
        if plan.all_single:  # decode: the rows are the queries, in order
            return self._single(q, kv_cache, plan, scale)
        out = torch.empty_like(q)
        if plan.single_rows is not None:
            out[plan.single_rows] = self._single(q[plan.single_rows], kv_cache, plan, scale)
        for c in plan.chunks:
            kv = kv_cache[c.blocks]  # [nb, 2, bs, Hkv, D]
            keys = kv[:, 0].to(q.dtype).flatten(0, 1)[: c.seq_len].transpose(0, 1).unsqueeze(0)
            vals = kv[:, 1].to(q.dtype).flatten(0, 1)[: c.seq_len].transpose(0, 1).unsqueeze(0)
            qs = q[c.rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            o = F.scaled_dot_product_attention(
                qs,
                keys,
                vals,
                attn_mask=c.mask,
                is_causal=c.mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[c.rows] = o.squeeze(0).transpose(0, 1)
        return out

    @staticmethod
    def _single(q: torch.Tensor, kv_cache: torch.Tensor, plan: _Plan, scale: float) -> torch.Tensor:
        """Attention of 1-token queries q [S, Hq, D], batched over their gathered blocks."""
        assert plan.single_tables is not None
        kv = kv_cache[plan.single_tables]  # [S, W, 2, bs, Hkv, D]
        # Widening on the K/V split is the copy that flattening the blocks makes anyway.
        keys = kv[:, :, 0].to(q.dtype).flatten(1, 2).transpose(1, 2)  # [S, Hkv, W*bs, D]
        vals = kv[:, :, 1].to(q.dtype).flatten(1, 2).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, vals, attn_mask=plan.single_mask, scale=scale, enable_gqa=True
        )
        return o.squeeze(2)
