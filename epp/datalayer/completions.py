"""Completion records from the engines, as a data-layer feed.

An engine started with ``--completion-events-port`` publishes one record per request the
EPP routed (key, HTTP status, prompt/completion/cached tokens, finish time; the format is
:mod:`infergate.wire.completions`). With them the EPP learns the end of a
response and its usage without seeing the response body, so its cost per request does
not grow with the response's length and Envoy can send it no response body at all
(``response_accounting="engine"`` in the Envoy bootstrap).

Endpoints that report: the endpoint label ``infergate.io/completion-events-port`` names
the port, or ``default_port`` applies to every endpoint. Endpoints without either are not
subscribed and the EPP finishes their requests at the response headers (no usage), as
before. Two subscriptions per reporting endpoint, because what they carry is needed at
different moments:

* **this replica's records** (its ``owner``'s topic,
  :func:`~infergate.wire.completions.records_topic`; a ZMQ SUB socket,
  :class:`ZmqFeed`): read as they arrive, since a record
  ends a request. ZMQ filters the other replicas' records out at the engine, so a
  replica is woken for the requests it routed only.
* **load reports and the other replicas' admission records** (``on_load``, see
  :mod:`infergate.epp.datalayer.load_reports`; ``on_admitted``, the prefix index): read
  only by :meth:`CompletionSubscriptions.refresh`, which the datastore runs right before
  a decision (and the collector at its next check of a quiet pool). Only each engine's
  newest load report is applied. Read as they arrived, they cost a replica a wakeup per
  message of every engine, ~190 us each on a shared core, so N replicas paid N times the
  background work (docs/benchmarks/scale.md, "Replicas"); read at the decision, the view
  is as fresh and the wakeups are gone. Over plain TCP (:class:`ZmtpFeed`), not a ZMQ
  socket, whose I/O thread would still receive each message as it came.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.datalayer.endpoint_tasks import ZmqSubscriptions
from infergate.epp.datalayer.zmq_feed import ZmqFeed
from infergate.epp.datalayer.zmtp import ZmtpFeed
from infergate.epp.types import Endpoint

from infergate.wire.completions import (
    ADMITTED_TOPIC,
    TOPIC,
    CompletionBatch,
    CompletionRecord,
    owner,
    records_topic,
)
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
        owner: str | None = None,
        on_admitted: Callable[[str, bytes], None] | None = None,
    ) -> None:
        self.datastore = datastore
        self.on_record = on_record
        self.default_port = default_port
        #: Load reports (:mod:`infergate.wire.load`), read lazily: (key, newest payload).
        self.on_load = on_load
        #: The key prefix of this replica's requests (``ExtProcServer.key_prefix``): only
        #: their records are subscribed to. None: every record.
        self.owner = owner
        #: Other replicas' admission records, read lazily: (key, packed prefix hashes).
        self.on_admitted = on_admitted
        #: Load reports read but not decoded: a newer one of the same engine followed.
        self.superseded = 0
        #: Times the records feeds' readers ran (the wakeups this replica pays).
        self.wakeups = 0
        self._lazy: dict[str, ZmtpFeed] = {}  # endpoint key -> its lazily read feed
        self._decoder = msgspec.msgpack.Decoder(CompletionBatch)
        super().__init__(datastore, "completions")
        datastore.on_refresh(self.refresh)
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
        """Receive ``endpoint``'s feeds for as long as it is in the pool.

        This replica's records are read as they arrive (the loop's reader callback,
        :class:`ZmqFeed`): a record ends a request, which frees its in-flight count and
        flow-control slot now. Load reports and the other replicas' admission records
        are only read by :meth:`refresh`, right before a decision.
        """
        port = self.port(endpoint)
        if port is None:
            return  # not a reporting endpoint
        host = f"[{endpoint.address}]" if ":" in endpoint.address else endpoint.address
        url = f"tcp://{host}:{port}"
        own = records_topic(self.owner) if self.owner is not None else TOPIC
        records = ZmqFeed(self._zmq, url, (own,), MAX_FRAME)
        lazy_topics = [LOAD_TOPIC] if self.on_load is not None else []
        if self.on_admitted is not None:
            lazy_topics.append(ADMITTED_TOPIC)
        lazy = ZmtpFeed(endpoint.address, port, lazy_topics, MAX_FRAME) if lazy_topics else None
        loop = asyncio.get_running_loop()

        def drain() -> None:
            self.wakeups += 1
            for frames in records.read():
                try:
                    self._take(endpoint.key, frames)
                except Exception:  # a sink's bug must not stop this endpoint's feed
                    log.exception("completion record from %s failed", endpoint.key)

        def redial() -> None:
            if records.redial():
                drain()

        descriptors = list(records.descriptors())
        loop.add_reader(descriptors[0], drain)
        loop.add_reader(descriptors[1], redial)
        if lazy is not None:
            self._lazy[endpoint.key] = lazy
            lazy.start()
        try:
            drain()  # what arrived before the readers were added
            redial()
            await loop.create_future()  # until the endpoint leaves (cancelled)
        finally:
            for descriptor in descriptors:
                loop.remove_reader(descriptor)
            records.close()
            if lazy is not None:
                if self._lazy.get(endpoint.key) is lazy:
                    del self._lazy[endpoint.key]
                lazy.close()

    def refresh(self) -> None:
        """Read the lazily read feeds: every engine's newest load report (older ones
        queued before it are read but not decoded) and the other replicas' admission
        records.

        Called right before a decision reads the endpoints (``Datastore.refresh``), so
        the decision sees each engine's newest report, as a reader woken per message
        would have; but a replica pays one read per decision rather than one wakeup per
        message, and the messages it reads grow with the engines' reports, not with the
        replicas.
        """
        for key, feed in self._lazy.items():
            try:
                self._read_lazy(key, feed)
            except Exception:  # a sink's bug must not stop the decision or other feeds
                log.exception("feed of %s failed", key)

    def _read_lazy(self, key: str, feed: ZmtpFeed) -> None:
        latest: bytes | None = None
        for frames in feed.read():
            if frames[0] == LOAD_TOPIC:
                if latest is not None:
                    self.superseded += 1
                latest = frames[-1]
            elif frames[0] == ADMITTED_TOPIC:
                self._take_admitted(key, frames[-1])
        if latest is not None and self.on_load is not None:
            self.on_load(key, latest)

    def _take_admitted(self, key: str, payload: bytes) -> None:
        """Admission records engine ``key`` took: the prefixes other replicas routed."""
        try:
            batch = self._decoder.decode(payload)
        except (msgspec.DecodeError, ValueError) as error:
            log.warning("bad admission batch from %s: %s", key, error)
            return
        for record in batch.records:
            if record.prefix and owner(record.key) != self.owner and self.on_admitted:
                self.on_admitted(key, record.prefix)

    def _take(self, key: str, frames: list[bytes]) -> None:
        """One message of endpoint ``key``'s records feed: a batch of records."""
        try:
            batch = self._decoder.decode(frames[-1])
        except (msgspec.DecodeError, ValueError) as error:
            log.warning("bad completion batch from %s: %s", key, error)
            return
        for record in batch.records:
            self.on_record(key, record)
