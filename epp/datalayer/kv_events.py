"""KV-cache events from the engines (vLLM's format), as a data-layer feed.

Each engine publishes over ZMQ PUB (``[topic, seq, msgpack batch]``; events
``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``). One subscription per endpoint
(``tcp://ADDRESS:PORT``, the port from the endpoint label ``infergate.io/kv-events-port``
or a default) decodes batches into a :class:`KVBlockIndex` and tells listeners when an
engine cleared its whole cache. The precise prefix scorer reads the index.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.datalayer.endpoint_tasks import ZmqSubscriptions
from infergate.epp.types import Endpoint

log = logging.getLogger("infergate.epp.kv_events")

KV_EVENTS_PORT_LABEL = "infergate.io/kv-events-port"


class KVBlockIndex:
    """Block hash → endpoints that hold it: confirmed by KV events, or speculative.

    A speculative entry is what the EPP itself just sent to an endpoint: the engine will
    store those blocks within a step or two, but its ``BlockStored`` event arrives later.
    Until then (at most ``ttl`` seconds) the entry counts as held — llm-d's speculative
    indexing — so a burst of one prefix group is not scattered before the first event.
    An event for the same block confirms it; an expired entry stops counting.
    """

    def __init__(self, ttl: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.holders: dict[Any, set[str]] = {}
        self.by_endpoint: dict[str, set[Any]] = {}
        self.speculative: dict[Any, dict[str, float]] = {}
        self.ttl = ttl
        self.clock = clock
        # LoRA adapter names seen in BlockStored events: a request for one of these is
        # hashed with the adapter in its block keys, as the engine hashes it.
        self.adapters: set[str] = set()

    def stored(self, endpoint: str, hashes: Sequence[Any]) -> None:
        mine = self.by_endpoint.setdefault(endpoint, set())
        for h in hashes:
            mine.add(h)
            self.holders.setdefault(h, set()).add(endpoint)
            guesses = self.speculative.get(h)
            if guesses is not None:
                guesses.pop(endpoint, None)
                if not guesses:
                    del self.speculative[h]

    def removed(self, endpoint: str, hashes: Sequence[Any]) -> None:
        mine = self.by_endpoint.get(endpoint)
        if mine is None:
            return
        for h in hashes:
            if h in mine:
                mine.discard(h)
                holders = self.holders.get(h)
                if holders is not None:
                    holders.discard(endpoint)
                    if not holders:
                        del self.holders[h]

    def cleared(self, endpoint: str) -> None:
        self.removed(endpoint, list(self.by_endpoint.get(endpoint, ())))
        self.by_endpoint.pop(endpoint, None)
        for h in [h for h, g in self.speculative.items() if endpoint in g]:
            self._drop_guess(h, endpoint)

    def speculate(self, endpoint: str, hashes: Sequence[Any]) -> None:
        """The EPP routed these blocks to ``endpoint``: count them held for ``ttl``."""
        until = self.clock() + self.ttl
        for h in hashes:
            if endpoint not in self.holders.get(h, ()):
                self.speculative.setdefault(h, {})[endpoint] = until
        if len(self.speculative) > 100_000:  # bounded: purge what expired
            now = self.clock()
            for h in list(self.speculative):
                for e, t in list(self.speculative[h].items()):
                    if t <= now:
                        self._drop_guess(h, e)

    def _drop_guess(self, h: Any, endpoint: str) -> None:
        guesses = self.speculative.get(h)
        if guesses is not None:
            guesses.pop(endpoint, None)
            if not guesses:
                del self.speculative[h]

    def _held_by(self, h: Any, now: float) -> set[str]:
        held = set(self.holders.get(h, ()))
        guesses = self.speculative.get(h)
        if guesses:
            held.update(e for e, until in guesses.items() if until > now)
        return held

    def leading_matches(self, hashes: Sequence[Any]) -> dict[str, int]:
        """Per endpoint, how many leading blocks of ``hashes`` it holds (0 omitted)."""
        now = self.clock()
        matches: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = self._held_by(h, now)
            if not holders:
                break
            alive = holders if alive is None else alive & holders
            if not alive:
                break
            for endpoint in alive:
                matches[endpoint] = i + 1
        return matches


def apply_batch(index: KVBlockIndex, endpoint: str, payload: bytes) -> dict[str, int]:
    """Apply one msgpack ``KVEventBatch`` (``[ts, events, dp_rank]``); returns event counts.

    Decoded generically (tagged arrays, tag first) so older and newer vLLM field lists work.
    """
    counts: dict[str, int] = {}
    batch = msgspec.msgpack.decode(payload)
    if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KV event batch")
    for event in batch[1]:
        if not isinstance(event, list | tuple) or not event:
            continue
        tag = event[0]
        if tag == "BlockStored" and len(event) > 1 and isinstance(event[1], list):
            index.stored(endpoint, event[1])
            # [tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name]
            if len(event) > 7 and isinstance(event[7], str) and event[7]:
                index.adapters.add(event[7])
        elif tag == "BlockRemoved" and len(event) > 1 and isinstance(event[1], list):
            index.removed(endpoint, event[1])
        elif tag == "AllBlocksCleared":
            index.cleared(endpoint)
        else:
            continue
        counts[tag] = counts.get(tag, 0) + 1
    return counts


class KVEventSubscriptions(ZmqSubscriptions):
    """One ZMQ SUB per endpoint feeding ``index``; ``cleared_listeners`` hear total evictions."""

    def __init__(
        self,
        datastore: Datastore,
        index: KVBlockIndex,
        default_port: int = 5557,
        metrics: Any = None,
    ) -> None:
        self.index = index
        self.default_port = default_port
        self.metrics = metrics
        self.cleared_listeners: list[Callable[[str], None]] = []
        super().__init__(datastore, "kv-events")
        self._tasks.removed_listeners.append(lambda e: index.cleared(e.key))

    def address(self, endpoint: Endpoint) -> str:
        port = endpoint.label(KV_EVENTS_PORT_LABEL) or str(self.default_port)
        host = f"[{endpoint.address}]" if ":" in endpoint.address else endpoint.address
        return f"tcp://{host}:{port}"

    async def _subscribe(self, endpoint: Endpoint) -> None:
        import zmq

        socket = self._zmq.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.address(endpoint))
        try:
            while True:
                frames = await socket.recv_multipart()
                try:
                    counts = apply_batch(self.index, endpoint.key, frames[-1])
                except Exception as error:
                    log.warning("bad KV event batch from %s: %s", endpoint.key, error)
                    continue
                if counts.get("AllBlocksCleared"):
                    for listener in self.cleared_listeners:
                        listener(endpoint.key)
                if self.metrics is not None:
                    for tag, n in counts.items():
                        self.metrics.kv_events.labels(tag).inc(n)
        finally:
            socket.close(0)
