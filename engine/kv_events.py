"""KV-cache events in vLLM's wire format, published over ZMQ PUB, with vLLM's replay socket.

Anything that consumes vLLM's events (llm-d's precise prefix scorer, our EPP) can consume
these. The format — live messages ``[topic, seq, payload]`` and the replay exchange — is
defined in :mod:`infergate.wire.kv_events`, which the EPP imports too; the structs are
re-exported here for the engine's own modules.

The replay socket (vLLM's ``replay_endpoint``) is a ZMQ ROUTER served by its own thread
(:class:`ReplayServer`): the publishing thread records each batch in a bounded buffer
just before sending it, so any batch a subscriber has seen can already be replayed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from itertools import count, islice
from typing import Any

import msgspec

from infergate.wire.kv_events import (
    END_OF_REPLAY,
    MEDIUM_GPU,
    SEQ_SIZE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_seq,
)

__all__ = [
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "KVEventBatch",
    "KVEventsConfig",
    "ReplayServer",
    "ZmqEventPublisher",
    "ZmqPublisher",
    "bind_endpoint",
    "decode_batch",
    "is_bind_endpoint",
]

log = logging.getLogger(__name__)


def is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


#: Hosts that mean "every interface": the publisher binds ZMQ's wildcard for them.
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "*"})


def bind_endpoint(host: str, port: int) -> str:
    """The ZMQ endpoint a publisher on ``port`` binds, on the engine's own ``--host``.

    A publisher opened by a port option (``--completion-events-port``,
    ``--kv-events-port``) listens where the HTTP server does: ``--host 127.0.0.1`` keeps
    it on loopback. Only a wildcard host (0.0.0.0, ::) binds every interface; ``::``
    gives ``tcp://[::]:PORT`` (IPv6, dual-stack where the kernel allows). An IPv6 literal
    is bracketed.
    """
    host = host.strip()
    if host == "::":
        return f"tcp://[::]:{port}"
    if host in WILDCARD_HOSTS:
        return f"tcp://*:{port}"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``--kv-events-config`` JSON (the fields we honour; others are refused)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    hwm: int = 100_000
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    max_queue_size: int = 100_000

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """Parse and check; raises ValueError with a readable message."""
        try:
            config = msgspec.json.decode(text, type=cls)
        except msgspec.DecodeError as error:  # ValidationError is a subclass
            raise ValueError(f"invalid --kv-events-config: {error}") from None
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"unsupported KV events publisher {config.publisher!r} (zmq, null)")
        if config.buffer_steps < 1:
            raise ValueError(
                f"KV events buffer_steps must be at least 1, got {config.buffer_steps}"
            )
        if config.hwm < 0:
            raise ValueError(f"KV events hwm must not be negative, got {config.hwm}")
        return config

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


class ZmqPublisher:
    """A ZMQ PUB socket fed from a background thread, so the caller never blocks on ZMQ.

    Each message is vLLM's framing: (topic, 8-byte big-endian sequence number, msgpack
    payload). :meth:`_run` sends one queued item per message; a subclass may batch.
    """

    thread_name = "zmq-publisher"
    what = "events"  # for the log line when a send fails

    def __init__(
        self, endpoint: str, *, topic: str = "", hwm: int = 100_000, bind: bool | None = None
    ) -> None:
        import zmq

        self._sock: Any = zmq.Context.instance().socket(zmq.PUB)
        self._sock.set_hwm(hwm)
        if "[" in endpoint:  # an IPv6 address ([::], [::1]): ZMQ needs IPv6 turned on
            self._sock.setsockopt(zmq.IPV6, 1)
        # bind=None is vLLM's rule: a wildcard host (or ipc/inproc) binds; a concrete
        # address connects (llm-d points engines at the Endpoint Picker's bound SUB socket
        # this way). A port option's endpoint (:func:`bind_endpoint`) always binds.
        if bind if bind is not None else is_bind_endpoint(endpoint):
            self._sock.bind(endpoint)
        else:
            self._sock.connect(endpoint)
        self._topic = topic.encode()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._seq = count()
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def _send(self, payload: Any, topic: bytes | None = None) -> None:
        """Send one message on ``topic`` (the publisher's own when None)."""
        try:
            seq = next(self._seq)
            data = self._encoder.encode(payload)
            self._record(seq, data)
            self._sock.send_multipart((topic or self._topic, encode_seq(seq), data))
        except Exception:  # a publishing hiccup must never take the engine down
            log.exception("failed to publish %s", self.what)

    def _record(self, seq: int, data: bytes) -> None:
        """Called with each batch just before it is sent (a replay buffer keeps it)."""

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._send(item)
        self._sock.close(linger=0)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)


class ZmqEventPublisher(ZmqPublisher):
    """Publishes KV event batches from a background thread so the step loop never blocks.

    With ``replay_endpoint`` it also serves vLLM's replay socket over the last
    ``buffer_steps`` batches (:class:`ReplayServer`).
    """

    thread_name = "kv-events"
    what = "KV events"

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        hwm: int = 100_000,
        bind: bool | None = None,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
    ) -> None:
        # The replay socket first: a busy replay port then fails before the PUB is bound.
        self._replay = None if replay_endpoint is None else ReplayServer(
            replay_endpoint, buffer_steps
        )  # fmt: skip
        try:
            super().__init__(endpoint, topic=topic, hwm=hwm, bind=bind)
        except Exception:
            if self._replay is not None:
                self._replay.close()
            raise

    def publish(self, events: list[KVEvent]) -> None:
        if events:
            self._queue.put(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))

    def _record(self, seq: int, data: bytes) -> None:
        if self._replay is not None:
            self._replay.record(seq, data)

    def close(self) -> None:
        super().close()
        if self._replay is not None:
            self._replay.close()


def _first_few(n: int) -> bool:
    """Log the 1st-3rd and every 1000th occurrence: a client may send anything, often."""
    return n <= 3 or n % 1000 == 0


class ReplayServer:
    """vLLM's KV-events replay socket: a ROUTER that answers "batches from seq N on".

    Why a thread of its own: a replay of thousands of batches to a slow client must not
    hold up publishing. The publishing thread only appends to the buffer (under a lock);
    this thread owns the socket. The wire exchange is :mod:`infergate.wire.kv_events`'s.

    Hardening, since anything that reaches the port may send anything: a request that is
    not one 8-byte sequence number is answered with the end marker alone (and logged, a
    few times); inbound messages over :attr:`max_request_bytes` drop the connection
    (ZMQ's ``MAXMSGSIZE``); a client that stops reading stalls a reply for at most
    :attr:`send_timeout_ms` per message before the reply is abandoned
    (``ROUTER_MANDATORY``, so a full pipe is an error rather than a silent drop that
    would lose the end marker).
    """

    poll_ms = 200
    send_timeout_ms = 1000
    max_request_bytes = 1024

    def __init__(self, endpoint: str, buffer_steps: int) -> None:
        import zmq

        sock: Any = zmq.Context.instance().socket(zmq.ROUTER)
        try:
            if "[" in endpoint:
                sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.SNDTIMEO, self.send_timeout_ms)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_request_bytes)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(endpoint)  # vLLM's rule: the replay endpoint always binds
        except Exception:
            sock.close(linger=0)
            raise
        self._sock = sock
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.bad_requests = 0  # malformed requests (counted for the rate-limited log)
        self.abandoned = 0  # replies cut short by a client that left or stopped reading
        self._thread = threading.Thread(target=self._run, name="kv-events-replay", daemon=True)
        self._thread.start()

    def record(self, seq: int, payload: bytes) -> None:
        with self._lock:
            self._buffer.append((seq, payload))

    def batches_from(self, start: int) -> list[tuple[int, bytes]]:
        """The buffered ``(seq, payload)`` with ``seq >= start``, oldest first."""
        with self._lock:
            if not self._buffer or self._buffer[-1][0] < start:
                return []
            skip = max(0, start - self._buffer[0][0])  # seqs are consecutive
            return [entry for entry in islice(self._buffer, skip, None) if entry[0] >= start]

    def _run(self) -> None:
        import zmq

        while not self._stopping.is_set():
            try:
                if not self._sock.poll(self.poll_ms):
                    continue
                self._answer(self._sock.recv_multipart(zmq.NOBLOCK))
            except zmq.ZMQError as error:  # EAGAIN: it stopped reading; EHOSTUNREACH: gone
                self.abandoned += 1
                if _first_few(self.abandoned):
                    log.warning("KV events replay: reply abandoned (%s); %d so far", error,
                                self.abandoned)  # fmt: skip
            except Exception:  # never let one request end replay for everyone
                log.exception("KV events replay failed")
        self._sock.close(linger=0)

    def _answer(self, frames: list[bytes]) -> None:
        envelope, request = frames[:1], frames[1:]
        if request and request[0] == b"":  # REQ, or a DEALER that sends the delimiter
            envelope.append(b"")
            request = request[1:]
        start = self._requested(request)
        for seq, payload in [] if start is None else self.batches_from(start):
            self._sock.send_multipart([*envelope, encode_seq(seq), payload])
        self._sock.send_multipart([*envelope, END_OF_REPLAY, b""])

    def _requested(self, request: list[bytes]) -> int | None:
        """The first sequence number asked for; None (logged) for a malformed request."""
        if len(request) == 1 and len(request[0]) == SEQ_SIZE:
            return int.from_bytes(request[0], "big")
        self.bad_requests += 1
        if _first_few(self.bad_requests):
            log.warning(
                "KV events replay: malformed request (%d frames, sizes %s; want one %d-byte "
                "sequence number); %d so far",
                len(request), [len(f) for f in request[:4]], SEQ_SIZE, self.bad_requests,
            )  # fmt: skip
        return None

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=2.0)
