"""The torch paged-attention backend against dense causal attention on the same tensors."""

from __future__ import annotations

import pytest
import torch
from infergate.engine.attention import (
    AttentionContext,
    TorchAttentionBackend,
    build_metadata,
    kv_cache_shape,
)

HQ, HKV, D, BS = 4, 2, 8, 4


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [n, HQ, D] are the last n positions of k/v [L, HKV, D]; plain causal softmax."""
    n, length = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
    q_pos = torch.arange(length - n, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_layout_is_flashinfer_nhd() -> None:
    assert kv_cache_shape(10, BS, HKV, D) == (10, 2, BS, HKV, D)


@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_step_matches_dense(seed: int) -> None:
    """One step holding: a decode, a 1-token chunk, a chunk after cached context (prefix
    hit / later prefill chunk) and a fresh prefill; blocks scattered over the pool."""
    g = torch.Generator().manual_seed(seed)
    # (context already cached, new tokens this step)
    shapes = [(9, 1), (3, 1), (6, 7), (0, 11)]
    cache = torch.zeros(kv_cache_shape(64, BS, HKV, D))
    backend = TorchAttentionBackend()
    perm = torch.randperm(64, generator=g).tolist()
    full_k, full_v, tables = [], [], []
    for ctx, n in shapes:
        length = ctx + n
        table = [perm.pop() for _ in range(-(-length // BS))]
        k = torch.randn(length, HKV, D, generator=g)
        v = torch.randn(length, HKV, D, generator=g)
        for p in range(ctx):  # what earlier steps would have written
            cache[table[p // BS], 0, p % BS] = k[p]
            cache[table[p // BS], 1, p % BS] = v[p]
        full_k.append(k)
        full_v.append(v)
        tables.append(table)
    meta = build_metadata(
        query_lens=[n for _, n in shapes],
        context_lens=[c for c, _ in shapes],
        block_tables=tables,
        block_size=BS,
        device=torch.device("cpu"),
    )
    backend.prepare(meta)
    qs = [torch.randn(n, HQ, D, generator=g) for _, n in shapes]
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes, strict=True)])
    actx = AttentionContext(backend, meta, [cache])
    out = actx.attend(0, torch.cat(qs), new_k, new_v, D**-0.5)
    expected = torch.cat(
        [dense_attention(q, k, v) for q, k, v in zip(qs, full_k, full_v, strict=True)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # New K/V landed in the right slots.
    for (c, n), k, table in zip(shapes, full_k, tables, strict=True):
        for p in range(c, c + n):
            torch.testing.assert_close(cache[table[p // BS], 0, p % BS], k[p])


def test_metadata_slots_and_positions() -> None:
    meta = build_metadata(
        query_lens=[2, 1],
        context_lens=[3, 5],
        block_tables=[[7, 2], [4, 9]],
        block_size=BS,
        device=torch.device("cpu"),
    )
    assert meta.positions.tolist() == [3, 4, 5]
    assert meta.slot_mapping.tolist() == [7 * BS + 3, 2 * BS + 0, 9 * BS + 1]
    assert meta.query_start_loc.tolist() == [0, 2, 3]
    assert meta.seq_lens.tolist() == [5, 6]


def test_forward_without_prepare_is_an_error() -> None:
    meta = build_metadata(
        query_lens=[1],
        context_lens=[0],
        block_tables=[[0]],
        block_size=BS,
        device=torch.device("cpu"),
    )
    x = torch.zeros(1, HQ, D)
    kv = torch.zeros(1, HKV, D)
    with pytest.raises(RuntimeError, match="prepare"):
        TorchAttentionBackend().forward(
            x, kv, kv, torch.zeros(kv_cache_shape(1, BS, HKV, D)), meta, 1.0
        )
