"""Chained KV-block hashes, shared by the engine and the EPP's precise-prefix plugin.

Pure Python + xxhash and deterministic across processes and machines (never Python's
``hash()``), so a router can hash a prompt exactly as the engine hashes its KV blocks and
match the ``block_hashes`` of the engine's KV events.

Recipe (version 1), for a token sequence cut into *full* blocks of ``block_size`` tokens
(a trailing partial block has no hash):

* ``extra`` for block 0 is ``cache_salt.encode("utf-8")`` when the request has a
  ``cache_salt`` (else ``b""``); for every later block it is ``b""``. The salt therefore
  changes every hash of the chain, because each hash covers its parent. A request run
  with a LoRA adapter prefixes it with ``0xFF || adapter name (UTF-8) || 0xFF`` (the
  adapter changes every layer's keys and values; 0xFF never occurs in UTF-8, so no salt
  can collide with an adapter). The adapter name is the model name of the request, so a
  router hashes it from the request alone.
* ``parent`` of block 0 is :data:`ROOT_HASH`; of block ``i`` it is the hash of block ``i-1``.
* ``hash = xxh64(seed=0)`` over the bytes
  ``parent (8 bytes little-endian, unsigned)
  || each token id (4 bytes little-endian, unsigned)
  || len(extra) (4 bytes little-endian) || extra``
  and the result is the unsigned 64-bit ``intdigest()``.

The base model's name is not part of the engine's hash: one engine serves one model and
the EPP keys its index per endpoint.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

HASH_VERSION = 1
#: The parent of a sequence's first block: xxh64 of the ASCII string below, seed 0.
ROOT_HASH: int = xxhash.xxh64_intdigest(b"infergate-kv-block-root-v1")


def hash_block(parent: int | None, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """Hash one block given its parent's hash (``None`` = first block) and its tokens."""
    h = xxhash.xxh64(seed=0)
    h.update(struct.pack("<Q", ROOT_HASH if parent is None else parent))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    return h.intdigest()


def first_block_extra(cache_salt: str | None, lora_name: str | None = None) -> bytes:
    """The extra key of block 0 (the salt isolates one tenant's cache from another's, the
    adapter one adapter's KV from another's and the base model's)."""
    salt = cache_salt.encode("utf-8") if cache_salt else b""
    if not lora_name:
        return salt
    return b"\xff" + lora_name.encode("utf-8") + b"\xff" + salt


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    parent: int | None = None,
    start_block: int = 0,
) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` (e.g. a prompt), in order.

    ``parent``/``start_block`` continue an existing chain: hash blocks ``start_block`` and
    onwards of ``token_ids`` given the hash of block ``start_block - 1``.
    """
    out: list[int] = []
    for i in range(start_block, len(token_ids) // block_size):
        extra = first_block_extra(cache_salt, lora_name) if i == 0 else b""
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        out.append(parent)
    return out
