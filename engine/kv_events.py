"""KV-cache events in vLLM's wire format, published over ZMQ PUB.

Anything that consumes vLLM's events (llm-d's precise prefix scorer, our EPP) can consume
these. The format, as vLLM's ``vllm/distributed/kv_events.py`` defines it:

* each ZMQ message is multipart ``[topic, seq, payload]``: ``topic`` (default empty),
  ``seq`` a 64-bit big-endian batch sequence number starting at 0, ``payload`` msgpack;
* ``payload`` is a ``KVEventBatch``, encoded as the array ``[ts, events,
  data_parallel_rank]``;
* each event is a tagged array whose first element is its class name:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]``,
  ``["AllBlocksCleared"]``. Block hashes are unsigned 64-bit ints
  (see :mod:`infergate.wire.block_hash`); ``medium`` is ``"GPU"`` as in vLLM (the
  engine's own KV memory, whatever the device).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from itertools import count
from typing import Any

import msgspec

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event structs (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    # No defaults, so omit_defaults never drops them: consumers index these positions.
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload (what a subscriber does); used by tests and tools."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)


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

    def _send(self, payload: Any) -> None:
        try:
            seq = next(self._seq).to_bytes(8, "big")
            self._sock.send_multipart((self._topic, seq, self._encoder.encode(payload)))
        except Exception:  # a publishing hiccup must never take the engine down
            log.exception("failed to publish %s", self.what)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._send(item)
        self._sock.close(linger=0)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)


class ZmqEventPublisher(ZmqPublisher):
    """Publishes KV event batches from a background thread so the step loop never blocks."""

    thread_name = "kv-events"
    what = "KV events"

    def publish(self, events: list[KVEvent]) -> None:
        if events:
            self._queue.put(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
