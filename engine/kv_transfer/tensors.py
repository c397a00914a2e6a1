"""Copy KV blocks out of and into a runner's per-layer KV tensors.

Each layer's cache is one tensor ``[num_blocks, 2, block_size, kv_heads, head_dim]``
(engine/attention/base.py). A payload stacks the selected blocks of every layer:
``[layers, n, 2, block_size, kv_heads, head_dim]``, sent as raw bytes of the cache dtype
(viewed as uint8, so bfloat16 travels too). Its size is exactly
``n × layers × 2 × block_size × kv_heads × head_dim × dtype bytes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def read_blocks(
    kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]
) -> tuple[dict[str, Any], bytes]:
    """The blocks' KV of every layer, as (layout, bytes)."""
    if not block_ids:
        return {"dtype": "", "shape": []}, b""
    index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_caches[0].device)
    stacked = torch.stack([c.index_select(0, index) for c in kv_caches]).cpu().contiguous()
    meta = {"dtype": str(stacked.dtype).removeprefix("torch."), "shape": list(stacked.shape)}
    return meta, stacked.view(torch.uint8).numpy().tobytes()


def write_blocks(
    kv_caches: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    meta: dict[str, Any],
    data: bytes,
    first: int = 0,
) -> None:
    """Write payload blocks ``first .. first + len(block_ids)`` into ``block_ids``.

    ``ValueError`` when the payload's layout does not match these caches (another model,
    dtype or block size) or is short: the caller then prefills locally.
    """
    cache = kv_caches[0]
    dtype = str(cache.dtype).removeprefix("torch.")
    shape = [int(x) for x in meta.get("shape") or []]
    if (
        meta.get("dtype") != dtype
        or len(shape) != cache.dim() + 1
        or shape[0] != len(kv_caches)
        or shape[2:] != list(cache.shape[1:])
        or shape[1] < first + len(block_ids)
    ):
        raise ValueError(
            f"KV payload layout {meta.get('dtype')} {shape} does not fit this engine's "
            f"{dtype} [{len(kv_caches)}, {first + len(block_ids)}+, "
            f"{', '.join(map(str, cache.shape[1:]))}]"
        )
    expected_bytes = cache.element_size()
    for dim in shape:
        expected_bytes *= dim
    if len(data) != expected_bytes:
        raise ValueError(f"KV payload has {len(data)} bytes, its layout needs {expected_bytes}")
    if not block_ids:
        return
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    tensor = raw.view(cache.dtype).reshape(shape)[:, first : first + len(block_ids)]
    index = torch.tensor(list(block_ids), dtype=torch.long, device=cache.device)
    for layer, layer_cache in enumerate(kv_caches):
        layer_cache.index_copy_(0, index, tensor[layer].to(layer_cache.device))
