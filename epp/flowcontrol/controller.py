"""The flow controller: admission becomes "enqueue, then await dispatch".

Why hold requests in the gateway at all: a request committed early to one engine waits in
that engine's FCFS queue behind whatever came first, whatever its priority, and is stuck
there even if another engine frees up sooner. Held here, it is ordered by priority band
and fairness flow (see ``queues.py``), and when it leaves the queue the normal scheduler
picks the endpoint *at that moment*.

Capacity (when the head of the queue may go):

- ``maxRequestsPerEndpoint = B``: the pool takes ``B * ready_endpoints`` requests that the
  flow controller dispatched and that have not finished (``in_flight`` counts them from
  dispatch to ``release``). This is exact and immediate, so it is the recommended gate.
  With several EPP replicas the budget is the pool's, shared: the pool's load is the
  larger of ``in_flight`` and the sum of every endpoint's :meth:`EndpointState.load`
  (the engines' reported running + waiting, which count every replica's requests,
  corrected by this replica's picks and finishes since each report). Replicas admit
  against what the engines say is there, not against a fixed share of ``B``: an idle
  replica does not strand capacity, and a dead one frees its share at the next report.
  The price is a race: between two reports (one refresh interval, 50 ms by default) each
  of N replicas may admit into the same free slots, so the pool can overshoot ``B`` per
  endpoint by up to (N - 1) × the slots free at the report. docs/epp.md compares this
  with a static ``B / N`` split.
- ``useSaturationDetector``: hold while every endpoint is saturated (queue depth / KV
  usage / stale metrics, the same detector the shed path uses). Scraped metrics lag by
  up to one refresh, so alone it can over-dispatch a burst; with the budget it is a brake
  on top of it.

- ``maxPrefillQueueSeconds = H``: hold while every endpoint has more than ``H`` seconds
  of prefill queued (``prefill_queue_seconds``), and release one request at a time: the
  next waits until the last is scheduled (``placed``), since until then its prefill is
  on no endpoint's clock and a whole queue would leave at once.

Dispatch is attempted whenever something could have changed: a request enqueued, a
request finished (``release``), and every ``dispatchInterval`` while anything waits (the
saturation detector's metrics change without an event). Everything runs on the EPP's
event loop, so no locks: a pump is a synchronous loop of pops.

Leaving the queue other than by dispatch: the TTL fires (429, reason ``ttl_expired``), the
bounds are exceeded at enqueue (429, reason ``queue_full``), or the waiting task is
cancelled — which is what grpc.aio does to the handler when Envoy closes the ext-proc
stream because the client went away — and the item is removed before the cancellation
propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.flowcontrol.config import FlowControlConfig
from infergate.epp.flowcontrol.metrics import FlowControlMetrics
from infergate.epp.flowcontrol.queues import DEFAULT_FLOW, BandQueues, QueueItem
from infergate.epp.flowcontrol.saturation import SaturationDetector
from infergate.epp.types import EndpointState

log = logging.getLogger("infergate.epp.flowcontrol")

#: GIE's fairness header: requests with the same value share one flow.
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
#: Longest fairness ID kept (longer ones are cut): a header is not a way to grow memory.
MAX_FAIRNESS_ID = 128


class FlowRejected(Exception):
    """The request leaves flow control without being dispatched; the director answers 429."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(slots=True)
class Ticket:
    """A dispatched request's claim on capacity; ``release`` it exactly once."""

    priority: int
    flow: str
    cost_estimate: float
    released: bool = False
    placing: bool = False  # dispatched under the prefill gate, not yet scheduled


def fairness_id(headers: dict[str, str]) -> str:
    value = headers.get(FAIRNESS_HEADER, "").strip()
    return value[:MAX_FAIRNESS_ID] if value else DEFAULT_FLOW


def prefill_queue_seconds(state: EndpointState, now: float) -> float:
    """Prefill queued on an endpoint, in seconds. From an engine that pushes load reports:
    its running and waiting requests' pending prefill with this EPP's picks since
    (``EndpointState.pending_prefill_seconds``), at the endpoint's cost per token.
    Otherwise the latency model's clock
    for it (its picks' predicted prefill, drained in real time). The report wins where
    there is one: the clock charges each pick its predicted work, and a hold on a
    predicted queue the engine no longer has leaves it idle."""
    if state.metrics.pushed:
        return state.pending_prefill_seconds(state.cost.per_token, now)
    return max(0.0, state.prefill_busy_until - now)


def cost_estimate(size_bytes: int, max_tokens: int | None) -> float:
    """Tokens charged at dispatch: ~4 bytes of prompt per token, plus the output asked for."""
    return max(1.0, size_bytes / 4 + (max_tokens or 0))


class FlowController:
    def __init__(
        self,
        config: FlowControlConfig,
        datastore: Datastore,
        saturation: SaturationDetector,
        metrics: FlowControlMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.datastore = datastore
        self.saturation = saturation
        self.metrics = metrics
        self.clock = clock
        self.queues = BandQueues(config.fairnessPolicy, config.prefillOrderWeight is not None)
        self.in_flight = 0
        #: Dispatched under ``maxPrefillQueueSeconds`` and not yet scheduled: their prefill
        #: is on no endpoint's clock yet, so the gate waits for them (``placed``).
        self.placing = 0
        self._ticker: asyncio.Task[None] | None = None
        metrics.bind(self)

    # -- admission ------------------------------------------------------------------------

    async def admit(
        self,
        priority: int,
        flow: str,
        size_bytes: int,
        max_tokens: int | None = None,
        prefill_seconds: float = 0.0,
    ) -> Ticket:
        """Wait until this request may be dispatched; raises FlowRejected (429) or the
        task's cancellation, and in every case the request is no longer queued after.
        ``prefill_seconds``: its predicted prefill, for ``prefillOrderWeight``."""
        band_max_requests, band_max_bytes = self.config.band(priority)
        band_requests, band_bytes = self.queues.band_size(priority)
        full = None
        if len(self.queues) + 1 > self.config.maxRequests:
            full = f"the flow-control queue holds its maximum of {self.config.maxRequests} requests"
        elif self.queues.bytes + size_bytes > self.config.maxBytes:
            full = f"the flow-control queue holds its maximum of {self.config.maxBytes} bytes"
        elif band_max_requests is not None and band_requests + 1 > band_max_requests:
            full = f"priority band {priority} holds its maximum of {band_max_requests} requests"
        elif band_max_bytes is not None and band_bytes + size_bytes > band_max_bytes:
            full = f"priority band {priority} holds its maximum of {band_max_bytes} bytes"
        if full is not None:
            self.metrics.rejected(priority, "queue_full")
            raise FlowRejected("queue_full", full)
        loop = asyncio.get_running_loop()
        now = self.clock()
        item = QueueItem(
            flow=flow,
            priority=priority,
            size=size_bytes,
            enqueued=now,
            cost_estimate=cost_estimate(size_bytes, max_tokens),
            waiter=loop.create_future(),
            order=now + (self.config.prefillOrderWeight or 0.0) * prefill_seconds,
        )
        self.queues.add(item)
        self.pump()
        waiter: asyncio.Future[Ticket] = item.waiter
        if waiter.done():
            return waiter.result()
        self._ensure_ticker()
        timer = loop.call_later(self.config.ttl(priority), self._expire, item)
        try:
            return await waiter
        except asyncio.CancelledError:
            if self.queues.remove(item):
                self.metrics.rejected(priority, "cancelled", self.clock() - item.enqueued)
            elif waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release(waiter.result())  # dispatched, but its client is gone
            raise
        finally:
            timer.cancel()

    def _expire(self, item: QueueItem) -> None:
        """The TTL fired: a still-queued item leaves with 429 ``ttl_expired``."""
        if not self.queues.remove(item):
            return
        self.metrics.rejected(item.priority, "ttl_expired", self.clock() - item.enqueued)
        item.waiter.set_exception(
            FlowRejected(
                "ttl_expired",
                f"the request waited {self.config.ttl(item.priority):g}s in the "
                "flow-control queue (its TTL) without capacity",
            )
        )

    def release(self, ticket: Ticket, actual_tokens: int | None = None) -> None:
        """The dispatched request finished (or never reached an engine): free its capacity
        and, with usage known, correct its flow's token charge by (actual - estimate)."""
        if ticket.released:
            return
        ticket.released = True
        self.in_flight = max(0, self.in_flight - 1)
        if ticket.placing:  # never scheduled
            ticket.placing = False
            self.placing -= 1
        if actual_tokens is not None:
            self.queues.charge(ticket.priority, ticket.flow, actual_tokens - ticket.cost_estimate)
        self.pump()

    def placed(self, ticket: Ticket) -> None:
        """The dispatched request was scheduled: its prefill is on its endpoint's clock,
        so the prefill gate may let the next one go (at once: pump)."""
        if ticket.placing:
            ticket.placing = False
            self.placing -= 1
            self.pump()

    # -- dispatch -------------------------------------------------------------------------

    def has_capacity(self) -> bool:
        states = self.datastore.all()
        if not states:
            return False
        budget = self.config.maxRequestsPerEndpoint
        if budget is not None and self.pool_load(states) >= budget * len(states):
            return False
        queue = self.config.maxPrefillQueueSeconds
        if queue is not None and (
            self.placing or min(prefill_queue_seconds(s, self.clock()) for s in states) > queue
        ):
            return False
        return not (self.config.useSaturationDetector and self.saturation.pool_saturated(states))

    def must_wait(self) -> bool:
        """Whether a request arriving now would wait (others wait, or no capacity)."""
        return bool(len(self.queues)) or not self.has_capacity()

    def pool_load(self, states: list[EndpointState]) -> int:
        """Requests in the pool, whoever admitted them (this replica's ``in_flight`` at
        least; with other replicas or routers, what the engines report)."""
        load = own = 0
        for state in states:
            load += state.load()
            own += state.in_flight_requests
        # Dispatched but not yet scheduled: in no endpoint's count yet.
        unpicked = max(0, self.in_flight - own)
        return max(self.in_flight, load + unpicked)

    def pump(self) -> int:
        """Dispatch while there is capacity and anything waits; returns how many went."""
        sent = 0
        if len(self.queues):
            self.datastore.refresh()  # capacity from the engines' newest load reports
        while len(self.queues) and self.has_capacity():
            item = self.queues.pop()
            if item is None:
                break
            waiter: asyncio.Future[Ticket] = item.waiter
            if waiter.done():  # cancelled between its removal and now: nothing to send
                continue
            self.in_flight += 1
            ticket = Ticket(item.priority, item.flow, item.cost_estimate)
            if self.config.maxPrefillQueueSeconds is not None:
                ticket.placing = True
                self.placing += 1
            waiter.set_result(ticket)
            self.metrics.dispatched(item.priority, self.clock() - item.enqueued)
            sent += 1
        return sent

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        """Re-check capacity every dispatchInterval while anything waits, then stop."""
        try:
            while len(self.queues):
                await asyncio.sleep(self.config.dispatchInterval)
                self.pump()
        except Exception:
            log.exception("flow-control dispatch tick failed")

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
