"""The bounded in-memory store behind ``store``, ``previous_response_id``, GET and cancel.

vLLM keeps every stored response forever (its store is opt-in for that reason); this one
holds at most ``max_entries`` responses, each for ``ttl_s`` seconds after it was last
written, so a long-running engine's memory stays bounded. The oldest entry goes first when
the store is full. An entry holds what a next turn needs to rebuild its conversation: the
turn's input items (the whole history, instructions excepted, as OpenAI does not carry
them over) and the response object with its output items.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_TTL_S = 3600.0


@dataclass
class StoredResponse:
    model: str
    response: dict[str, Any]  # the Response object as last sent (status, output, usage)
    history: list[dict[str, Any]]  # input items of every turn up to this one, as dicts
    cancel: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def status(self) -> str:
        return str(self.response.get("status"))

    def conversation(self) -> list[dict[str, Any]]:
        """The items a next turn continues from: this turn's input, then its output."""
        return [*self.history, *self.response.get("output", [])]


class ResponseStore:
    """An LRU-by-write map of response id → :class:`StoredResponse`, with a TTL."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if max_entries < 1 or ttl_s <= 0:
            raise ValueError("the response store needs max_entries >= 1 and ttl_s > 0")
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self._entries: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Insert or refresh an entry (it becomes the newest); evict past the bound."""
        self._entries.pop(response_id, None)
        self._entries[response_id] = (self.clock() + self.ttl_s, entry)
        self._expire()
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def discard(self, response_id: str) -> None:
        self._entries.pop(response_id, None)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        held = self._entries.get(response_id)
        return held[1] if held is not None else None

    def _expire(self) -> None:
        """Drop expired entries; they are in write order, so the oldest come first."""
        now = self.clock()
        while self._entries:
            first = next(iter(self._entries))
            if self._entries[first][0] > now:
                return
            del self._entries[first]
