"""KV-cache events from the engines (vLLM's format), as a data-layer feed.

Each engine publishes over ZMQ PUB (``[topic, seq, msgpack batch]``; events
``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``; :mod:`infergate.wire.kv_events`).
One subscription per endpoint (``tcp://ADDRESS:PORT``, the port from the endpoint label
``infergate.io/kv-events-port`` or a default) decodes batches into a :class:`KVBlockIndex`
and tells listeners when an engine cleared its whole cache. The precise prefix scorer
reads the index.

PUB/SUB loses messages silently (a reconnect, a full queue), and a lost ``BlockRemoved``
leaves the index claiming blocks the engine no longer holds. So the subscription follows
``seq``: on a jump it asks the engine's replay socket (vLLM's ``replay_endpoint``; port
from the label ``infergate.io/kv-events-replay-port`` or a default) for the missing
batches and applies them in order. When the engine no longer holds them (or has no
replay socket), the endpoint's entries are dropped instead, since they can no longer be
trusted, and rebuilt from the batches that follow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.datalayer.endpoint_tasks import ZmqSubscriptions
from infergate.epp.types import Endpoint

from infergate.wire.kv_events import END_OF_REPLAY, SEQ_SIZE, decode_seq, encode_seq

log = logging.getLogger("infergate.epp.kv_events")

KV_EVENTS_PORT_LABEL = "infergate.io/kv-events-port"
KV_EVENTS_REPLAY_PORT_LABEL = "infergate.io/kv-events-replay-port"


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


Batch = tuple[int, bytes]  # (seq, msgpack payload)


@dataclass
class _Cursor:
    """Where one endpoint's event stream stands."""

    applied: int | None = None  # the last seq applied to the index (None: none yet)
    live: int | None = None  # the last seq received on the SUB socket
    # seq → hash(payload) of replayed batches the SUB socket may still deliver: the same
    # seq with another payload is a restarted engine's, not a duplicate.
    replayed: dict[int, int] = field(default_factory=dict)

    def reset(self) -> None:
        self.applied = None
        self.replayed.clear()

    def is_replayed(self, seq: int, payload: bytes) -> bool:
        """Whether this live batch is one a replay already applied; forgets older ones."""
        seen = self.replayed.get(seq) == hash(payload)
        while self.replayed and next(iter(self.replayed)) <= seq:
            del self.replayed[next(iter(self.replayed))]
        return seen


def _contiguous(batches: Sequence[Batch], first: int) -> list[Batch]:
    """The leading run of ``batches`` numbered ``first, first + 1, …``."""
    run: list[Batch] = []
    for batch in batches:
        if batch[0] != first + len(run):
            break
        run.append(batch)
    return run


def _live_seq(frames: Sequence[bytes]) -> int | None:
    """The seq of a live message ``[topic, seq, payload]``; None when framed otherwise."""
    if len(frames) != 3 or len(frames[1]) != SEQ_SIZE:
        return None
    return decode_seq(frames[1])


class KVEventSubscriptions(ZmqSubscriptions):
    """One ZMQ SUB per endpoint feeding ``index``; ``cleared_listeners`` hear total evictions.

    ``replay_timeout``: seconds to wait for each message of a replay before giving up on
    it (an engine without a replay socket never answers).
    """

    replay_timeout = 2.0

    def __init__(
        self,
        datastore: Datastore,
        index: KVBlockIndex,
        default_port: int = 5557,
        metrics: Any = None,
        default_replay_port: int | None = None,
    ) -> None:
        self.index = index
        self.default_port = default_port
        self.default_replay_port = default_replay_port
        self.metrics = metrics
        self.cleared_listeners: list[Callable[[str], None]] = []
        super().__init__(datastore, "kv-events")
        self._tasks.removed_listeners.append(lambda e: index.cleared(e.key))

    @staticmethod
    def _tcp(endpoint: Endpoint, port: str) -> str:
        host = f"[{endpoint.address}]" if ":" in endpoint.address else endpoint.address
        return f"tcp://{host}:{port}"

    def address(self, endpoint: Endpoint) -> str:
        return self._tcp(endpoint, endpoint.label(KV_EVENTS_PORT_LABEL) or str(self.default_port))

    def replay_address(self, endpoint: Endpoint) -> str | None:
        """The engine's replay socket, or None when neither label nor default names one."""
        port = endpoint.label(KV_EVENTS_REPLAY_PORT_LABEL) or self.default_replay_port
        return None if port is None else self._tcp(endpoint, str(port))

    async def _subscribe(self, endpoint: Endpoint) -> None:
        import zmq

        socket = self._zmq.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.address(endpoint))
        cursor = _Cursor()
        try:
            await self._join(endpoint, cursor)
            while True:
                await self._receive(endpoint, await socket.recv_multipart(), cursor)
        finally:
            socket.close(0)

    async def _join(self, endpoint: Endpoint, cursor: _Cursor) -> None:
        """Learn what the engine holds already (the EPP restarted, or the endpoint joined the
        pool late): every batch it still buffers, from 0 on. A buffer that no longer starts
        at 0 gives part of the truth (see :meth:`_catch_up`), never more."""
        if self.replay_address(endpoint) is None:
            return
        batches = await self._replay(endpoint, 0)
        if batches:
            self._apply_run(endpoint.key, _contiguous(batches, batches[0][0]), cursor)
            log.info("KV events of %s: joined with batches %d-%d replayed", endpoint.key,
                     batches[0][0], cursor.applied)  # fmt: skip

    async def _receive(self, endpoint: Endpoint, frames: list[bytes], cursor: _Cursor) -> None:
        """Apply one live message in sequence, filling any gap before it first."""
        seq = _live_seq(frames)
        if seq is None:  # not vLLM's framing: applied as it comes, without tracking
            self._apply(endpoint.key, frames[-1])
            return
        replayed = cursor.is_replayed(seq, frames[2])
        if (cursor.live is not None and seq <= cursor.live) or (
            cursor.applied is not None and seq <= cursor.applied and not replayed
        ):
            # A new publisher (the engine restarted): its numbering starts again.
            log.info("KV events of %s restarted at seq %d; index rebuilt", endpoint.key, seq)
            self.index.cleared(endpoint.key)
            cursor.reset()
        cursor.live = seq
        if cursor.applied is not None and seq <= cursor.applied:
            return  # a replay already brought this batch
        expected = 0 if cursor.applied is None else cursor.applied + 1
        if seq > expected:
            await self._catch_up(endpoint, expected, seq, cursor)
            if cursor.applied is not None and seq <= cursor.applied:
                return
        self._apply(endpoint.key, frames[2])
        cursor.applied = seq

    async def _catch_up(self, endpoint: Endpoint, expected: int, seq: int, cursor: _Cursor) -> None:
        """Batches ``expected … seq - 1`` never arrived: replay them, or drop the endpoint's
        entries. With nothing applied yet (no replay answered at :meth:`_join`) the
        subscription replays from 0 to learn what the engine holds; that is no gap, so it
        is neither counted nor cleared."""
        joining = cursor.applied is None
        batches = await self._replay(endpoint, expected)
        run = _contiguous(batches, expected)
        if run and run[-1][0] >= seq - 1:
            if not joining:
                self._count_gap("filled")
                log.info("KV events of %s: batches %d-%d replayed", endpoint.key, expected, seq - 1)
        else:
            if not joining:
                self._count_gap("dropped")
                log.warning(
                    "KV events of %s: batches %d-%d lost (%s); its index entries are dropped",
                    endpoint.key, expected, seq - 1,
                    f"replay starts at {batches[0][0]}" if batches else "no replay",
                )  # fmt: skip
                self.index.cleared(endpoint.key)
            # What the engine still buffers, when it reaches the live batch, rebuilds part
            # of the index: every block it stores and does not remove is really held.
            run = _contiguous(batches, batches[0][0]) if batches else []
            if not (run and run[0][0] <= seq <= run[-1][0] + 1):
                run = []
        self._apply_run(endpoint.key, run, cursor)
        if cursor.applied is None or cursor.applied < seq - 1:
            cursor.applied = seq - 1

    def _apply_run(self, endpoint_key: str, run: Sequence[Batch], cursor: _Cursor) -> None:
        """Apply replayed batches (consecutive, in order) and move the cursor past them."""
        for seq, payload in run:
            self._apply(endpoint_key, payload)
            cursor.applied = seq
            cursor.replayed[seq] = hash(payload)
        if self.metrics is not None and run:
            self.metrics.kv_events_replayed.inc(len(run))

    async def _replay(self, endpoint: Endpoint, start: int) -> list[Batch]:
        """The batches from ``start`` on that the engine's replay socket still holds
        (possibly starting later, possibly none); [] without a replay socket."""
        import zmq

        address = self.replay_address(endpoint)
        if address is None:
            return []
        socket = self._zmq.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        batches: list[Batch] = []
        try:
            socket.connect(address)
            await socket.send_multipart([b"", encode_seq(start)])
            while await socket.poll(self.replay_timeout * 1000):
                frames = await socket.recv_multipart()
                if len(frames) != 3 or frames[0] != b"" or len(frames[1]) != SEQ_SIZE:
                    log.warning("KV events replay from %s: unexpected reply framing", address)
                    return batches
                if frames[1] == END_OF_REPLAY:
                    return batches
                batches.append((decode_seq(frames[1]), frames[2]))
            log.warning("KV events replay from %s: no answer in %ss", address, self.replay_timeout)
        except zmq.ZMQError as error:
            log.warning("KV events replay from %s failed: %s", address, error)
        finally:
            socket.close(0)
        return batches

    def _apply(self, endpoint_key: str, payload: bytes) -> None:
        try:
            counts = apply_batch(self.index, endpoint_key, payload)
        except Exception as error:
            log.warning("bad KV event batch from %s: %s", endpoint_key, error)
            return
        if counts.get("AllBlocksCleared"):
            for listener in self.cleared_listeners:
                listener(endpoint_key)
        if self.metrics is not None:
            for tag, n in counts.items():
                self.metrics.kv_events.labels(tag).inc(n)

    def _count_gap(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.kv_event_gaps.labels(result).inc()
