"""Approximate prefix-cache affinity (GIE's ``prefix-cache-scorer``).

The EPP cannot see the engines' KV caches, so it remembers what it sent where: the prompt
is cut into fixed-size character blocks (``blockSizeTokens`` × 4 characters, GIE's
estimate of a token), each block's hash chains over the previous one and starts from a
hash of the target model and ``cache_salt``, so equal hashes mean equal prefixes. Each
endpoint keeps an LRU of the block hashes routed to it (bounded by
``lruCapacityPerServer``). The score is the fraction of the request's blocks that form a
cached prefix on that endpoint; hashes are recorded for the chosen endpoint at
pre-request.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence

import xxhash
from infergate.epp.scheduling.plugins.base import (
    PluginContext,
    PrepareData,
    PreRequest,
    SchedulingResult,
    Scorer,
    register,
)
from infergate.epp.types import CycleState, Endpoint, EndpointState, InferenceRequest
from pydantic import BaseModel, ConfigDict, Field

CHARS_PER_TOKEN = 4


class PrefixParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    blockSizeTokens: int = Field(16, ge=1)
    blockSize: int = Field(0, ge=0, description="Legacy: block size in characters (wins if > 0).")
    maxPrefixBlocksToMatch: int = Field(256, ge=1)
    lruCapacityPerServer: int = Field(31250, ge=1)
    autoTune: bool = True  # accepted for GIE compatibility; the block size stays fixed here


def prompt_bytes(request: InferenceRequest) -> bytes:
    """The text whose prefix decides cache reuse: chat messages (as JSON) or the prompt."""
    body = request.body or {}
    messages = body.get("messages")
    if isinstance(messages, list):
        return json.dumps(messages, separators=(",", ":"), ensure_ascii=False).encode()
    return request.prompt_text.encode()


def block_hashes(
    model: str, cache_salt: str, data: bytes, block_chars: int, max_blocks: int
) -> list[int]:
    """Chained xxh64 hashes of ``data`` cut into ``block_chars`` blocks (last one partial)."""
    if block_chars <= 0 or len(data) < block_chars:
        return []
    data = data[: block_chars * max_blocks]
    previous = xxhash.xxh64_intdigest((model + cache_salt).encode())
    hashes: list[int] = []
    for start in range(0, len(data), block_chars):
        previous = xxhash.xxh64_intdigest(
            data[start : start + block_chars] + previous.to_bytes(8, "little")
        )
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """Block hash → endpoints holding it, with a bounded LRU per endpoint."""

    def __init__(self, capacity_per_server: int) -> None:
        self.capacity = capacity_per_server
        self._servers: dict[str, OrderedDict[int, None]] = {}
        self._holders: dict[int, set[str]] = {}

    def add(self, server: str, hashes: Sequence[int]) -> None:
        lru = self._servers.setdefault(server, OrderedDict())
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            self._holders.setdefault(h, set()).add(server)
            if len(lru) > self.capacity:
                old, _ = lru.popitem(last=False)
                self._discard(old, server)

    def _discard(self, h: int, server: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(server)
            if not holders:
                del self._holders[h]

    def remove(self, server: str, hashes: Sequence[int]) -> None:
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

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Per server, how many leading blocks of ``hashes`` it holds (0 omitted)."""
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


@register
class PrefixCacheScorer(PrepareData, Scorer, PreRequest):
    type_name = "prefix-cache-scorer"
    Params = PrefixParams

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        p: PrefixParams = params  # type: ignore[assignment]
        self.block_chars = p.blockSize or p.blockSizeTokens * CHARS_PER_TOKEN
        self.max_blocks = p.maxPrefixBlocksToMatch
        self.index = PrefixIndex(p.lruCapacityPerServer)
        context.datastore.subscribe(self._on_endpoints)
        # Real evictions reported by engines (precise-prefix-cache-scorer) correct this index.
        context.extras.setdefault("kv_cache_cleared_listeners", []).append(self.index.clear_server)
        self.lookups = 0
        self.hit_blocks = 0
        self.total_blocks = 0

    def _on_endpoints(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        for endpoint in removed:
            self.index.clear_server(endpoint.key)

    async def prepare(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> None:
        hashes = block_hashes(
            request.target_model,
            request.cache_salt,
            prompt_bytes(request),
            self.block_chars,
            self.max_blocks,
        )
        matches = self.index.match(hashes) if hashes else {}
        cycle["prefix.hashes"] = hashes
        cycle["prefix.matches"] = matches
        cycle["prefix.max_match"] = max(matches.values(), default=0)
        if hashes:
            self.lookups += 1
            self.total_blocks += len(hashes)

    def score(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> list[float]:
        hashes = cycle.get("prefix.hashes") or []
        if not hashes:
            return [0.0] * len(endpoints)
        matches: dict[str, int] = cycle.get("prefix.matches") or {}
        total = len(hashes)
        return [matches.get(e.key, 0) / total for e in endpoints]

    def pre_request(
        self, cycle: CycleState, request: InferenceRequest, result: SchedulingResult
    ) -> None:
        hashes = cycle.get("prefix.hashes") or []
        primary = result.primary
        if not hashes or primary is None:
            return
        matches: dict[str, int] = cycle.get("prefix.matches") or {}
        self.hit_blocks += matches.get(primary.key, 0)
        cycle["prefix.hit_ratio"] = matches.get(primary.key, 0) / len(hashes)
        self.index.add(primary.key, hashes)
