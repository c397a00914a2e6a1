"""The approximate prefix index and its block hashing: the Python copy and the native one.

The prefix-cache scorer (:mod:`infergate.epp.scheduling.plugins.prefix`) remembers which
prompt blocks it routed where; this module holds that memory. The native module
``infergate.epp.scheduling._prefix_index`` (``native/prefix_index``, built by setup.py
next to this file, typed by ``_prefix_index.pyi``) is a copy of what is written here in
Python: :class:`PythonPrefixIndex` and :func:`python_block_hashes`. Both live in one
module so that the two copies, and the one choice between them (:data:`PrefixIndex`,
:func:`packed_block_hashes`), are read and changed together; the native module loads
under the EPP's one fallback policy (:func:`infergate.epp.native.load_native`).

It sits below the scheduling plugins: they import it, it imports none of them.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import xxhash
from infergate.epp.native import load_native

from infergate.wire.completions import unpack_hashes

if TYPE_CHECKING:
    import infergate.epp.scheduling._prefix_index as native
else:  # native/prefix_index, optional (setup.py); its absence is said once (epp/native.py)
    native = load_native(
        "infergate.epp.scheduling._prefix_index",
        "the prefix scorer uses its Python index (same results, more CPU per request)",
    )


def packed_block_hashes(
    model: str, cache_salt: str, data: bytes, block_chars: int, max_blocks: int
) -> bytes:
    """Chained xxh64 hashes of ``data`` cut into ``block_chars`` blocks (last one partial):
    ``h[i] = xxh64(block[i] ‖ le64(h[i-1]))`` from ``h[-1] = xxh64(model ‖ cache_salt)``,
    over the first ``max_blocks`` blocks, packed as little-endian u64s (8 bytes a block).

    Packed because that is how the index takes them and how the prefix header sends them:
    no Python int per hash on the request path. Native where built (same values)."""
    if block_chars <= 0 or len(data) < block_chars:
        return b""
    seed = (model + cache_salt).encode("utf-8", "replace")
    if native is not None:
        return native.block_hashes(seed, data, block_chars, max(0, max_blocks))
    return python_block_hashes(seed, data, block_chars, max_blocks)


def block_hashes(
    model: str, cache_salt: str, data: bytes, block_chars: int, max_blocks: int
) -> list[int]:
    """:func:`packed_block_hashes` as ints."""
    return unpack_hashes(packed_block_hashes(model, cache_salt, data, block_chars, max_blocks))


def python_block_hashes(seed: bytes, data: bytes, block_chars: int, max_blocks: int) -> bytes:
    """:func:`packed_block_hashes` without the native module."""
    data = data[: block_chars * max_blocks]
    previous = xxhash.xxh64_intdigest(seed)
    hashes: list[int] = []
    for start in range(0, len(data), block_chars):
        previous = xxhash.xxh64_intdigest(
            data[start : start + block_chars] + previous.to_bytes(8, "little")
        )
        hashes.append(previous)
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def tail_first(hashes: bytes) -> bytes:
    """Packed hashes (8 bytes each) in reverse order: the prompt's last block first.

    The index's LRU makes the hashes of one :meth:`PythonPrefixIndex.add` recent in the
    order given, so the first is evicted first. An engine frees a finished request's
    blocks tail first (vLLM's free queue, ``engine/core/kv_cache_manager.py``), so under
    pressure it drops the unique suffix and then a prefix from its end, keeping the
    shared head: added in prompt order, a full index dropped the head instead, and with
    it every match of the group (:meth:`PythonPrefixIndex.match` counts leading blocks),
    while the engine still held all but the tail. Recording a use tail first evicts in
    the engine's order.
    """
    if len(hashes) <= 8:
        return hashes
    return memoryview(hashes).cast("Q")[::-1].tobytes()


def _ints(hashes: bytes | Sequence[int]) -> Sequence[int]:
    """The index's methods take packed hashes or ints, as the native index does."""
    return unpack_hashes(hashes) if isinstance(hashes, bytes) else hashes


class PythonPrefixIndex:
    """Block hash → endpoints holding it, with a bounded LRU per endpoint.

    Each entry stores the sequence number of its last use, so ``drop_older_than`` can
    remove everything an LRU engine must have evicted before a given block. Where the
    native module is built, :data:`PrefixIndex` is its copy of this class (same methods,
    same results; ``tests/epp/test_prefix_index.py`` runs both on the same operations).
    """

    def __init__(self, capacity_per_server: int) -> None:
        self.capacity = capacity_per_server
        self._capacities: dict[str, int] = {}
        self._servers: dict[str, OrderedDict[int, int]] = {}
        self._holders: dict[int, set[str]] = {}
        self._seq = 0

    def set_capacity(self, server: str, blocks: int) -> None:
        """Bound ``server``'s LRU to ``blocks`` entries (evicting now if it shrank)."""
        blocks = max(1, blocks)
        if self._capacities.get(server) == blocks:
            return
        self._capacities[server] = blocks
        lru = self._servers.get(server)
        while lru is not None and len(lru) > blocks:
            old, _ = lru.popitem(last=False)
            self._discard(old, server)

    def capacity_of(self, server: str) -> int:
        return self._capacities.get(server, self.capacity)

    def add(self, server: str, hashes: bytes | Sequence[int]) -> None:
        hashes = _ints(hashes)
        lru = self._servers.setdefault(server, OrderedDict())
        capacity = self.capacity_of(server)
        for h in hashes:
            self._seq += 1
            if h in lru:
                lru[h] = self._seq
                lru.move_to_end(h)
                continue
            lru[h] = self._seq
            self._holders.setdefault(h, set()).add(server)
            if len(lru) > capacity:
                old, _ = lru.popitem(last=False)
                self._discard(old, server)

    def _discard(self, h: int, server: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(server)
            if not holders:
                del self._holders[h]

    def last_use(self, server: str, h: int) -> int | None:
        lru = self._servers.get(server)
        return lru.get(h) if lru is not None else None

    def last_uses(self, server: str, hashes: bytes | Sequence[int]) -> list[int]:
        """:meth:`last_use` of each hash, 0 where ``server`` does not hold it."""
        hashes = _ints(hashes)
        lru: Mapping[int, int] = self._servers.get(server) or {}
        return [lru.get(h, 0) for h in hashes]

    def drop_older_than(self, server: str, seq: int) -> int:
        """Drop ``server``'s entries last used at or before ``seq``; returns how many."""
        lru = self._servers.get(server)
        dropped = 0
        while lru:
            h, used = next(iter(lru.items()))
            if used > seq:
                break
            lru.popitem(last=False)
            self._discard(h, server)
            dropped += 1
        return dropped

    def remove(self, server: str, hashes: bytes | Sequence[int]) -> None:
        hashes = _ints(hashes)
        lru = self._servers.get(server)
        if lru is None:
            return
        for h in hashes:
            if h in lru:
                del lru[h]
                self._discard(h, server)

    def clear_server(self, server: str) -> None:
        for h in self._servers.pop(server, {}):
            self._discard(h, server)
        self._capacities.pop(server, None)

    def match(self, hashes: bytes | Sequence[int]) -> dict[str, int]:
        """Per server, how many leading blocks of ``hashes`` it holds (0 omitted)."""
        hashes = _ints(hashes)
        matches: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for server in alive:
                matches[server] = i + 1
        return matches

    def size(self, server: str) -> int:
        return len(self._servers.get(server, ()))

    def servers(self) -> list[str]:
        return list(self._servers)


PrefixIndex: type[PythonPrefixIndex] = (
    PythonPrefixIndex if native is None else native.PrefixIndex  # type: ignore[assignment]
)
