"""The engine's side of completion records: one per HTTP request the EPP routed.

The record format, its topic and the header that keys it are in
:mod:`infergate.wire.completions` (shared with the EPP's subscriber). Here: the
per-request token totals (:class:`Usage`, filled by the async engine), the ASGI middleware
that publishes a record when the response ends or the client goes away
(:class:`CompletionReporter`), and the ZMQ publisher that batches them.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import time
from collections.abc import Callable
from itertools import count
from typing import Any

from infergate.engine.kv_events import ZmqPublisher

from infergate.wire import load
from infergate.wire.completions import (
    ADMITTED,
    ADMITTED_TOPIC,
    CLIENT_GONE,
    KEY_HEADER,
    PREFIX_KEY_HEADER,
    TOPIC,
    CompletionBatch,
    CompletionRecord,
    decode_prefix,
    owner,
    records_topic,
)

log = logging.getLogger(__name__)


class Usage:
    """Token totals of one HTTP request, summed over the engine requests it made.

    ``n`` choices of one prompt share the prompt's token list: its prompt (and cached)
    tokens count once, as in the response's ``usage``; completion tokens count per choice.
    ``on_submit``, when set, is called once, with the first prompt's token count, as the
    first engine request is submitted: the admission record goes out then.
    """

    __slots__ = ("_prompts", "cached_tokens", "completion_tokens", "on_submit", "prompt_tokens")

    def __init__(self, on_submit: Callable[[int], None] | None = None) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self._prompts: set[int] = set()
        self.on_submit = on_submit

    def submitted(self, prompt_tokens: int) -> None:
        """An engine request of this HTTP request was submitted (its prompt tokenized)."""
        callback, self.on_submit = self.on_submit, None
        if callback is not None:
            callback(prompt_tokens)

    def add(self, prompt_id: int, prompt_tokens: int, output_tokens: int, cached: int) -> None:
        self.completion_tokens += output_tokens
        if prompt_id not in self._prompts:
            self._prompts.add(prompt_id)
            self.prompt_tokens += prompt_tokens
            self.cached_tokens += cached


CURRENT: contextvars.ContextVar[Usage | None] = contextvars.ContextVar(
    "infergate_completion_usage", default=None
)
"""The HTTP request's ``Usage`` while its handler runs (set by :class:`CompletionReporter`)."""


class CompletionPublisher(ZmqPublisher):
    """Publishes records from a background thread, batching whatever queued meanwhile."""

    thread_name = "completions"
    what = "completion records"

    def __init__(self, endpoint: str, *, hwm: int = 100_000) -> None:
        # Always bound: the EPP's subscribers connect to each engine (bind_endpoint).
        super().__init__(endpoint, topic=TOPIC.decode(), hwm=hwm, bind=True)

    def publish(self, record: CompletionRecord) -> None:
        self._queue.put(record)

    def publish_load(self, report: load.LoadReport) -> None:
        """Queue a load report; it goes out on its own topic (:mod:`infergate.wire.load`)."""
        self._queue.put(report)

    def _send_load(self, report: load.LoadReport) -> None:
        try:
            seq = next(self._load_seq).to_bytes(8, "big")
            self._sock.send_multipart((load.TOPIC, seq, load.encode(report)))
        except Exception:  # a publishing hiccup must never take the engine down
            log.exception("failed to publish a load report")

    def _run(self) -> None:
        self._load_seq = count()
        stop = False
        while not stop:
            first = self._queue.get()
            if first is None:
                break
            records: list[CompletionRecord] = []
            item = first
            while True:
                if isinstance(item, load.LoadReport):  # the socket is this thread's alone
                    self._send_records(records)  # what was queued before it goes first
                    records = []
                    self._send_load(item)
                else:
                    records.append(item)
                if len(records) >= 1024:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
            self._send_records(records)
        self._sock.close(linger=0)

    def _send_records(self, records: list[CompletionRecord]) -> None:
        """One batch per routing replica, on its own topic, and the admission records that
        carry prefix hashes once more, for every replica (:mod:`infergate.wire.completions`,
        "Topics"), at once. A replica is sent the records of the requests it routed, not
        every replica's. The prefixes the others routed wait, unread, in its socket until
        its next decision reads them (the EPP's lazily read feed): they cost it no wakeup,
        so they are not held back for a load report to travel with, which left another
        replica blind to them for up to 20 ms more (docs/benchmarks/scale.md, "Replicas")."""
        if not records:
            return
        by_owner: dict[str, list[CompletionRecord]] = {}
        shared: list[CompletionRecord] = []
        for record in records:
            by_owner.setdefault(owner(record.key), []).append(record)
            if record.status == ADMITTED and record.prefix:
                shared.append(record)
        now = time.time()
        for key_owner, mine in by_owner.items():
            self._send(CompletionBatch(ts=now, records=mine), records_topic(key_owner))
        if shared:
            self._send(CompletionBatch(ts=now, records=shared), ADMITTED_TOPIC)


class CompletionReporter:
    """ASGI middleware: one record per HTTP request that carries the EPP's key header.

    It makes the request's :class:`Usage` current (the async engine adds each finished
    engine request to it) and publishes when the last body byte has been handed to the
    server, or when the handler ends any other way (client gone, error).

    Its admission record goes first, when the engine takes its prompt (the first engine
    request submitted): the prompt's token count, which lets the routing EPP learn the
    model's characters per token from its first request rather than its first response,
    and the EPP's prefix-hashes header echoed when the request carries one (a malformed
    or oversized value is dropped, never an error), so the other EPP replicas learn where
    the prefix went. A request refused before it reaches the engine has none.
    """

    def __init__(self, app: Any, publisher: CompletionPublisher) -> None:
        self.app = app
        self.publisher = publisher

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = ""
        prefix = b""
        for name, value in scope.get("headers", ()):
            if name == KEY_HEADER:
                key = value.decode("latin-1")
            elif name == PREFIX_KEY_HEADER:
                prefix = decode_prefix(value)
        if not key:
            await self.app(scope, receive, send)
            return

        def admitted(prompt_tokens: int) -> None:
            self.publisher.publish(
                CompletionRecord(key, ADMITTED, prompt_tokens, 0, 0, time.time(), prefix)
            )

        usage = Usage(admitted)
        status = 0
        sent = False

        def publish(code: int) -> None:
            nonlocal sent
            if not sent:
                sent = True
                self.publisher.publish(
                    CompletionRecord(
                        key,
                        code,
                        usage.prompt_tokens,
                        usage.completion_tokens,
                        usage.cached_tokens,
                        time.time(),
                    )
                )

        async def reporting_send(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                publish(status)

        token = CURRENT.set(usage)
        try:
            await self.app(scope, receive, reporting_send)
        finally:
            CURRENT.reset(token)
            publish(CLIENT_GONE)  # no-op when the response ended; else it did not reach the client
