"""Completion records from the engines, as a data-layer feed.

An engine started with ``--completion-events-port`` publishes one record per request the
EPP routed (key, HTTP status, prompt/completion/cached tokens, finish time; the format is
:mod:`infergate.wire.completions`). With them the EPP learns the end of a
response and its usage without seeing the response body, so its cost per request does
not grow with the response's length and Envoy can send it no response body at all
(``response_accounting="engine"`` in the Envoy bootstrap).

One ZMQ SUB per endpoint that reports: the endpoint label
``infergate.io/completion-events-port`` names the port, or ``default_port`` applies to
every endpoint. Endpoints without either are not subscribed and the EPP finishes their
requests at the response headers (no usage), as before. Every EPP replica receives
every record and keeps the ones it routed (``on_record`` looks the key up). The same
socket carries the engine's load reports (``on_load``; see
:mod:`infergate.epp.datalayer.load_reports`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import msgspec
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.datalayer.endpoint_tasks import ZmqSubscriptions
from infergate.epp.types import Endpoint

from infergate.wire.completions import CompletionBatch, CompletionRecord
from infergate.wire.load import TOPIC as LOAD_TOPIC

#: The largest frame taken from an engine (a batch of 1,024 records is ~100 KB).
MAX_FRAME = 8 << 20

log = logging.getLogger("infergate.epp.completions")

COMPLETION_EVENTS_PORT_LABEL = "infergate.io/completion-events-port"

RecordSink = Callable[[str, CompletionRecord], None]
"""Called with (endpoint key, record) for every record received."""


class CompletionSubscriptions(ZmqSubscriptions):
    def __init__(
        self,
        datastore: Datastore,
        on_record: RecordSink,
        default_port: int | None = None,
        on_removed: Callable[[str], None] | None = None,
        on_load: Callable[[str, bytes], None] | None = None,
    ) -> None:
        self.datastore = datastore
        self.on_record = on_record
        self.default_port = default_port
        #: Load reports (:mod:`infergate.wire.load`) ride the same socket: (key, payload).
        self.on_load = on_load
        self._decoder = msgspec.msgpack.Decoder(CompletionBatch)
        super().__init__(datastore, "completions")
        #: Whether every endpoint now known reports (see :meth:`reports_all`).
        self._all_report = False
        datastore.subscribe(self._endpoints_changed)
        if on_removed is not None:
            self._tasks.removed_listeners.append(lambda e: on_removed(e.key))

    def port(self, endpoint: Endpoint) -> int | None:
        label = endpoint.label(COMPLETION_EVENTS_PORT_LABEL)
        if label:
            try:
                return int(label)
            except ValueError:
                log.warning("endpoint %s: bad %s %r", endpoint.key, COMPLETION_EVENTS_PORT_LABEL,
                            label)  # fmt: skip
                return None
        return self.default_port

    def reports_all(self) -> bool:
        """Whether every endpoint of the pool reports completions: then a request's end and
        status come from its record whichever endpoint it goes to, and the EPP may ask
        Envoy not to send it the response headers (``StreamState`` in ``server/stream.py``)."""
        return self._all_report

    def _endpoints_changed(self, _added: list[Endpoint], _removed: list[Endpoint]) -> None:
        states = self.datastore.all()
        self._all_report = bool(states) and all(self.port(s.endpoint) is not None for s in states)

    def reports(self, endpoint_key: str) -> bool:
        """Whether ``endpoint_key`` reports completions (its requests wait for a record)."""
        state = self.datastore.get(endpoint_key)
        return state is not None and self.port(state.endpoint) is not None

    async def _subscribe(self, endpoint: Endpoint) -> None:
        """Receive ``endpoint``'s records for as long as it is in the pool.

        Why not ``await socket.recv_multipart()``: pyzmq's asyncio socket makes a future
        and a task step per message, and every routed request brings a record (two with
        admission records). A plain socket read from the loop's reader callback, drained
        with ``NOBLOCK`` (the ZMQ descriptor is edge-triggered: it signals once for all
        that is queued), costs 60-90 us less per message (``benchmarks/epp_record_feed.py``,
        3,000 messages 1 ms apart: 211-219 against 278-300 us of process CPU per message,
        the publisher thread's share included).

        A frame over ``MAX_FRAME`` makes ZMQ drop the connection, and libzmq 4.3 never
        dials that peer again (measured): one bad batch would silence the endpoint for
        good. A monitor socket reports each disconnection, and the feed redials.
        """
        import zmq

        port = self.port(endpoint)
        if port is None:
            return  # not a reporting endpoint
        host = f"[{endpoint.address}]" if ":" in endpoint.address else endpoint.address
        url = f"tcp://{host}:{port}"
        socket = self._socket()
        # A plain PAIR (get_monitor_socket would make an asyncio one on this context).
        watch = f"inproc://completions-monitor-{id(socket)}"
        socket.monitor(watch, zmq.EVENT_DISCONNECTED)
        monitor = zmq.Socket(self._zmq, zmq.PAIR)
        monitor.connect(watch)
        socket.connect(url)
        loop = asyncio.get_running_loop()

        def drain() -> None:
            while socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                try:
                    frames = socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return
                try:
                    self._take(endpoint.key, frames)
                except Exception:  # a sink's bug must not stop this endpoint's feed
                    log.exception("completion record from %s failed", endpoint.key)

        def redial() -> None:
            dropped = False
            while int(monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                try:
                    monitor.recv_multipart(zmq.NOBLOCK)  # (event, value), endpoint
                except zmq.Again:
                    break
                dropped = True
            if dropped:
                log.warning("completion feed of %s dropped; redialling %s", endpoint.key, url)
                with contextlib.suppress(zmq.ZMQError):  # not connected: connecting is enough
                    socket.disconnect(url)
                socket.connect(url)
                drain()

        descriptors = [int(socket.getsockopt(zmq.FD)), int(monitor.getsockopt(zmq.FD))]
        loop.add_reader(descriptors[0], drain)
        loop.add_reader(descriptors[1], redial)
        try:
            drain()  # what arrived before the readers were added
            redial()
            await loop.create_future()  # until the endpoint leaves (cancelled)
        finally:
            for descriptor in descriptors:
                loop.remove_reader(descriptor)
            socket.disable_monitor()
            monitor.close(0)
            socket.close(0)

    def _socket(self) -> Any:
        """A plain SUB socket on the shared context, subscribed to records (and load)."""
        import zmq

        socket = zmq.Socket(self._zmq, zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"completions")
        if self.on_load is not None:
            socket.setsockopt(zmq.SUBSCRIBE, LOAD_TOPIC)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)  # a peer sending more is cut off
        return socket

    def _take(self, key: str, frames: list[bytes]) -> None:
        """One message of endpoint ``key``: a load report or a batch of records."""
        if frames[0] == LOAD_TOPIC and self.on_load is not None:
            self.on_load(key, frames[-1])
            return
        try:
            batch = self._decoder.decode(frames[-1])
        except (msgspec.DecodeError, ValueError) as error:
            log.warning("bad completion batch from %s: %s", key, error)
            return
        for record in batch.records:
            self.on_record(key, record)
