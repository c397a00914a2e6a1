"""The Envoy ext-proc server: GIE's Endpoint Picker Protocol over FULL_DUPLEX_STREAMED.

One gRPC stream is one HTTP request, one :class:`~.stream.StreamState` (its phases: see
``stream``): the request body is buffered, routed, and the pick answered with the
``x-gateway-destination-endpoint`` header plus the same value as dynamic metadata
``envoy.lb``, followed by the body; the response is passed back while usage is read.
:class:`ExtProcServer` holds what the streams share: the Director, the limits and their
budget, the routed requests awaiting the engines' completion records. Its ``Process`` is
grpc.aio's servicer; ``h2`` drives the same streams on the event loop itself.

Memory is bounded (``Limits``): request bodies buffered across all streams share one
byte budget, concurrent streams have a cap, and a body must finish arriving within a
deadline. Beyond them the EPP answers at once with an OpenAI-shaped error — 503 for its
own limits (the client may retry, possibly on another replica), 408 for a body that
trickles past the deadline, 413 for one request over its own cap — so a flood of slow
or large uploads can never grow the process without bound. The budget covers a body
from its first chunk until its request ends (a routed request keeps its parsed prompt),
and the h2 transport charges it with what it holds (echoed bodies queued for Envoy's
windows). Worst-case RSS is about the idle RSS + 2.5 x ``max_buffered_bytes`` (the
budget, plus the joined copy and decoded document of the bodies being routed) + ~20 KiB
per stream; after a burst freed memory goes back to the kernel (``_settled``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.message import DecodeError
from infergate.epp.heap import TRIM_THRESHOLD, trim_heap
from infergate.epp.requestcontrol.director import Director

from infergate.wire.completions import ADMITTED, CompletionRecord

from .messages import immediate
from .observer import ObserverState
from .stream import StreamState
from .stream_base import Phase, StreamBase

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Limits:
    """What one EPP process holds for requests in flight (see the module docstring)."""

    max_body_bytes: int = 8 << 20
    """One request's body; larger gets 413."""
    max_buffered_bytes: int = 128 << 20
    """Request bodies held across all streams (buffered, or routed and in flight, or in
    the transport); a chunk that would pass it gets 503."""
    max_streams: int = 10_000
    """Concurrent ext-proc streams; the next one gets 503 at its first message."""
    body_timeout_s: float | None = 20.0
    """From request headers to the body's last chunk; past it 408. Under Envoy's
    ext-proc ``message_timeout`` (30 s in our bootstrap) so the client gets our answer."""


#: A burst that held this many body bytes at once has its freed memory given back once
#: it is over (``ExtProcServer._settled``): glibc's own trim threshold (``heap``).
TRIM_AFTER_BYTES = TRIM_THRESHOLD
#: Held bytes counted as none: what the transport's write buffer may hold unseen.
SETTLED_BYTES = 1 << 20
#: The most often memory is given back (a trim holds the loop: 72 ms for 240 MiB freed).
TRIM_INTERVAL_S = 5.0


class ExtProcServer(pb_grpc.ExternalProcessorServicer):
    """What every ext-proc stream of one EPP shares (see the module docstring)."""

    def __init__(
        self,
        director: Director,
        limits: Limits | int = Limits(),
        scores_header: bool = False,
        reports_completions: Callable[[str], bool] | None = None,
        reports_all: Callable[[], bool] | None = None,
        record_timeout_s: float = 330.0,
        record_settle_s: float = 1.0,
    ) -> None:
        self.director = director
        # An int is the old signature's max_body_bytes.
        self.limits = limits if isinstance(limits, Limits) else Limits(max_body_bytes=limits)
        self.scores_header = scores_header
        self.active_streams = 0
        self.buffered_bytes = 0
        #: Body bytes the HTTP/2 transport holds beyond the streams' sight (partial
        #: messages; echoed bodies queued until Envoy's windows take them, which left
        #: ``buffered_bytes`` when they were routed): charged to the same budget.
        self.transport_bytes = 0
        #: Times a burst's freed memory was given back to the kernel (:meth:`_settled`).
        self.trims = 0
        self._burst_peak = 0  # the most held since the last trim
        self._last_trim = -TRIM_INTERVAL_S
        self._trim_timer: asyncio.TimerHandle | None = None
        self.metrics = director.metrics
        self.routed: dict[str, StreamBase] = {}  # REQUEST_ID_HEADER -> its routing stream
        # Routed requests' keys: random per server, then counted (a uuid4 per request
        # read the kernel's randomness each time, a system call on the request path).
        #: This server's part of every key it makes: engines publish its records on a
        #: topic of their own (``wire.completions.records_topic``).
        self.key_prefix = os.urandom(8).hex()
        self._keys = itertools.count(1)
        #: Whether an endpoint reports completion records (None: none does). Its 2xx
        #: responses then finish when the record arrives, or after ``record_timeout_s``
        #: (a record lost: PUB/SUB drops while disconnected) as incomplete.
        self.reports_completions = reports_completions
        #: Whether every endpoint reports completions (None: not known, taken as no).
        self.reports_all = reports_all
        self.record_timeout_s = record_timeout_s
        #: How long the engine's counts must keep showing an awaited response finished
        #: before its record is given up (see :meth:`_counted_out`).
        self.record_settle_s = record_settle_s
        self.awaiting: dict[str, StreamBase] = {}  # streams ended, record not yet in
        #: Called with (endpoint, packed hashes) of requests another replica routed.
        self.on_admitted: Callable[[str, bytes], Any] | None = None

    def new_key(self) -> str:
        """A routed request's ``x-infergate-request-id``: unique among this EPP's requests
        and, by its 64 random bits, among every replica's (engines' records carry it to
        all of them)."""
        return f"{self.key_prefix}-{next(self._keys):x}"

    def await_record(self, state: StreamBase) -> None:
        if state.key not in self.awaiting:
            now = asyncio.get_running_loop().time()
            state.awaiting_since = now
            state.record_deadline = now + self.record_timeout_s
            self.awaiting[state.key] = state

    def on_record(self, endpoint: str, record: CompletionRecord) -> None:
        """A record from ``endpoint``. Completion records of other replicas are ignored;
        admission records of other replicas go to ``on_admitted`` (the prefix index), this
        replica's own to the director's request-admitted hooks (the prompt's token count)."""
        state = self.routed.get(record.key)
        if record.status == ADMITTED:
            if state is None:
                if record.prefix and self.on_admitted is not None:
                    self.on_admitted(endpoint, record.prefix)
            elif state.decision is not None and record.prompt_tokens > 0:
                self.director.admitted(state.decision, record.prompt_tokens)
            return
        if state is not None:
            state.take_record(record)

    def expire_records(self, now: float, gone: str | None = None) -> int:
        """Give up on records past their deadline (or all of endpoint ``gone``'s)."""
        expired = [
            s for s in self.awaiting.values()
            if s.record_deadline <= now or (gone is not None and s.endpoint_key == gone)
        ]  # fmt: skip
        seen = set(expired)
        expired += [s for s in self._counted_out(now) if s not in seen]
        for state in expired:
            self.count("record_lost")
            state.take_record(None)
        return len(expired)

    def _counted_out(self, now: float) -> list[StreamBase]:
        """Awaited responses that their engine's own counts show finished.

        A request whose response headers were sent stays in its engine's running (or,
        preempted, waiting) count until it finishes. So of the responses awaited since
        before an engine's latest scrape, at most running + waiting can still be live;
        the rest finished and their records were lost (PUB/SUB drops). The oldest are
        given up first: a count bound, so whichever is released the endpoint's in-flight
        count becomes right. A response is given up only once the counts have shown it
        finished for ``record_settle_s``: a record sent as its request finished, or a
        request admitted just after the scrape was rendered, settles within that. An
        engine whose scrape lacks either gauge is not judged (its counts read 0).
        """
        by_endpoint: dict[str, list[StreamBase]] = {}
        for state in self.awaiting.values():
            by_endpoint.setdefault(state.endpoint_key, []).append(state)
        out: list[StreamBase] = []
        for key, states in by_endpoint.items():
            endpoint = self.director.datastore.get(key)
            metrics = endpoint.metrics if endpoint is not None else None
            suspects: set[StreamBase] = set()
            if metrics is not None and metrics.updated_at > 0.0 and metrics.counts_reported:
                before = sorted(
                    (s for s in states if s.awaiting_since < metrics.updated_at),
                    key=lambda s: s.awaiting_since,
                )
                suspects = set(before[: max(0, len(before) - metrics.running - metrics.waiting)])
            for state in states:
                if state not in suspects:
                    state.counted_out_since = 0.0
                elif not state.counted_out_since:
                    state.counted_out_since = now
                elif now - state.counted_out_since >= self.record_settle_s:
                    out.append(state)
        return out

    @property
    def max_body_bytes(self) -> int:
        return self.limits.max_body_bytes

    def count(self, outcome: str) -> None:
        self.metrics.requests.labels(outcome).inc()

    def reserve(self, size: int) -> bool:
        """Take ``size`` bytes of the shared body budget; False when it would overflow.
        What the transport holds (``transport_bytes``) counts against it too."""
        held = self.buffered_bytes + self.transport_bytes + size
        if held > self.limits.max_buffered_bytes:
            return False
        self.buffered_bytes += size
        self._burst_peak = max(self._burst_peak, held)
        return True

    def release(self, size: int) -> None:
        self.buffered_bytes = max(0, self.buffered_bytes - size)
        self._settled()

    def hold_in_transport(self, delta: int) -> None:
        """The transport holds ``delta`` more body bytes (fewer when negative)."""
        self.transport_bytes = max(0, self.transport_bytes + delta)
        if delta > 0:
            self._burst_peak = max(self._burst_peak, self.buffered_bytes + self.transport_bytes)
        else:
            self._settled()

    def _settled(self) -> None:
        """After a burst (``TRIM_AFTER_BYTES`` held at once, or half the budget if less),
        once almost nothing is held, give the freed memory back
        (:func:`~infergate.epp.heap.trim_heap`), at most every ``TRIM_INTERVAL_S``
        (later, on a timer, if the last was too recent).

        Why: the burst's buffers are freed all over malloc's heap, which keeps them
        (measured 534 MiB of RSS, 43 MiB in use, after 100 bodies of 8 MiB). A small
        residue (``SETTLED_BYTES``) counts as settled: the transport's write buffer is
        read only when it writes, so a few KiB may be left over from its last write.
        """
        burst = min(TRIM_AFTER_BYTES, self.limits.max_buffered_bytes // 2)
        if self._burst_peak < burst or self._trim_timer is not None:
            return
        if self.buffered_bytes + self.transport_bytes > SETTLED_BYTES:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside a loop (a test driving streams by hand): no timer
            loop = None
        now = loop.time() if loop is not None else self._last_trim + TRIM_INTERVAL_S
        wait = self._last_trim + TRIM_INTERVAL_S - now
        if wait > 0 and loop is not None:
            self._trim_timer = loop.call_later(wait, self._trim_later)
            return
        self._burst_peak = 0
        self._last_trim = now
        if trim_heap():
            self.trims += 1
            log.debug("burst over: freed memory given back to the kernel")

    def _trim_later(self) -> None:
        self._trim_timer = None
        self._settled()

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        loop = asyncio.get_running_loop()
        state = StreamState(self, loop)
        self.active_streams += 1
        messages = request_iterator.__aiter__()
        observer: ObserverState | None = None
        try:
            if self.active_streams > self.limits.max_streams:
                self.count("overloaded_503")
                state.phase = Phase.DONE
                log.warning("ext-proc stream refused: %d streams open", self.active_streams - 1)
                try:  # answer Envoy's first message (its request headers), hold nothing
                    await messages.__anext__()
                except StopAsyncIteration:
                    return
                yield immediate(503, "the endpoint picker has too many requests open; retry")
                return
            while True:
                try:
                    if observer is not None:
                        message = await messages.__anext__()
                        observer.handle(message)
                        continue
                    if state.phase is Phase.BODY and state.deadline:
                        message = await asyncio.wait_for(
                            messages.__anext__(), max(0.0, state.deadline - loop.time())
                        )
                    else:
                        message = await messages.__anext__()
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    for response in state.timed_out():
                        yield response
                    return
                except DecodeError as error:
                    # Not a ProcessingRequest: a broken or foreign client, not a fault
                    # here. One line (gRPC would log a traceback per stream), and the
                    # stream ends with INVALID_ARGUMENT; `finally` releases its state.
                    log.warning(
                        "ext-proc stream from %s: corrupt frame (%s)", context.peer(), error
                    )
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, "corrupt ProcessingRequest"
                    )
                if message.observability_mode and state.phase is Phase.HEADERS:
                    observer = ObserverState(self)  # never answered (Envoy does not wait)
                    observer.handle(message)
                    continue
                try:
                    responses = await state.handle(message)
                except Exception:
                    log.exception(
                        "ext-proc stream failed while handling %s", message.WhichOneof("request")
                    )
                    self.count("error")
                    state.phase = Phase.DONE
                    responses = [immediate(500, "the endpoint picker failed on this request")]
                for response in responses:
                    yield response
                if state.ends_with_pick:  # OK trailers: Envoy sends no response headers
                    return
        finally:
            if observer is not None:
                observer.end(complete=False)
            else:
                state.close()
            self.active_streams -= 1
