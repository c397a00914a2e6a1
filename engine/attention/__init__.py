"""Attention backends over the paged KV cache (see `base` for the layout and contract)."""

from __future__ import annotations

from .base import (
    AttentionBackend,
    AttentionContext,
    AttentionMetadata,
    build_metadata,
    kv_cache_shape,
)
from .torch_backend import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionContext",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "build_metadata",
    "get_backend",
    "kv_cache_shape",
]


def get_backend(name: str = "torch") -> AttentionBackend:
    """The backend called `name`; "torch" is portable, others plug in per device."""
    if name == "torch":
        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (available: torch)")
