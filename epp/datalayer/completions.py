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

import logging
from collections.abc import Callable

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
        Envoy not to send it the response headers (``StreamState`` in ``server.py``)."""
        return self._all_report

    def _endpoints_changed(self, _added: list[Endpoint], _removed: list[Endpoint]) -> None:
        states = self.datastore.all()
        self._all_report = bool(states) and all(self.port(s.endpoint) is not None for s in states)

    def reports(self, endpoint_key: str) -> bool:
        """Whether ``endpoint_key`` reports completions (its requests wait for a record)."""
        state = self.datastore.get(endpoint_key)
        return state is not None and self.port(state.endpoint) is not None

    async def _subscribe(self, endpoint: Endpoint) -> None:
        import zmq

        port = self.port(endpoint)
        if port is None:
            return  # not a reporting endpoint
        host = f"[{endpoint.address}]" if ":" in endpoint.address else endpoint.address
        socket = self._zmq.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"completions")
        if self.on_load is not None:
            socket.setsockopt(zmq.SUBSCRIBE, LOAD_TOPIC)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)  # a peer sending more is cut off
        socket.connect(f"tcp://{host}:{port}")
        try:
            while True:
                frames = await socket.recv_multipart()
                if frames[0] == LOAD_TOPIC and self.on_load is not None:
                    self.on_load(endpoint.key, frames[-1])
                    continue
                try:
                    batch = self._decoder.decode(frames[-1])
                except (msgspec.DecodeError, ValueError) as error:
                    log.warning("bad completion batch from %s: %s", endpoint.key, error)
                    continue
                for record in batch.records:
                    self.on_record(endpoint.key, record)
        finally:
            socket.close(0)
