"""Priority bands of fairness flows of FCFS queues: the data structure flow control holds.

Ordering (GIE's three layers, written here for one process):

1. **Bands, strict priority.** A band per InferenceObjective priority; the highest
   non-empty band dispatches first. Lower bands wait as long as a higher one has work —
   that is the point (critical overtakes batch); the TTL bounds how long they wait.
2. **Flows, fairness inside a band.** A flow per fairness ID (the
   ``x-gateway-inference-fairness-id`` header; ``default`` without it).
   - ``round-robin``: the band keeps a ring of its non-empty flows and takes one request
     from each in turn, so k backlogged flows each get 1/k of the band's dispatches
     whatever their arrival rates (a tenant sending 10x gets no more turns).
   - ``token-fair-share``: each flow carries ``served``, the tokens charged to it; the
     band dispatches from the non-empty flow with the least ``served``. A request is
     charged an estimate at dispatch (prompt bytes / 4 + max_tokens, at least 1) and
     corrected by (actual - estimate) when its usage arrives, so backlogged flows converge
     to equal *tokens*, not equal requests. A flow that becomes non-empty starts at
     ``max(served, min served of the band's non-empty flows)``: idle time banks no credit
     (start-time fair queuing), so a returning tenant cannot burst ahead for long.
3. **Requests, FCFS inside a flow** (an insertion-ordered dict: O(1) append, pop of the
   oldest, and removal by id when a client leaves or a TTL fires). With ``ordered``
   (``prefillOrderWeight``), the least ``order`` first instead: ``enqueued + w ×
   predicted prefill seconds``, so a short prefill overtakes a long one that arrived up
   to ``w`` times its own prefill earlier (a heap beside the dict, O(log n) per request;
   an item removed by id leaves its heap entry behind, skipped at pop, and the heap is
   rebuilt once such entries outnumber the items).

Counters (requests, bytes per band and in total) change with every add/remove, so the
bounds are checked in O(1) and an emptied flow or band is dropped at once: nothing stays
behind for a request that left.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

DEFAULT_FLOW = "default"
HISTORY_LIMIT = 4096
_ids = itertools.count(1)


@dataclass(slots=True, eq=False)
class QueueItem:
    """One waiting request. ``waiter`` is what the controller resolves at dispatch."""

    flow: str
    priority: int
    size: int
    enqueued: float
    cost_estimate: float = 1.0
    waiter: Any = None
    order: float = 0.0  # the dispatch order inside its flow when the queues are ordered
    id: int = field(default_factory=lambda: next(_ids))


@dataclass(slots=True)
class Flow:
    fairness_id: str
    items: OrderedDict[int, QueueItem] = field(default_factory=OrderedDict)
    bytes: int = 0
    served: float = 0.0  # tokens charged (token-fair-share)
    heap: list[tuple[float, int]] = field(default_factory=list)  # (order, id) when ordered


@dataclass(slots=True)
class Band:
    priority: int
    flows: dict[str, Flow] = field(default_factory=dict)
    ring: deque[str] = field(default_factory=deque)  # non-empty flows, next turn first
    requests: int = 0
    bytes: int = 0


class BandQueues:
    """All waiting requests; single-threaded (the EPP's event loop owns it)."""

    def __init__(self, policy: str = "round-robin", ordered: bool = False) -> None:
        if policy not in ("round-robin", "token-fair-share"):
            raise ValueError(f"unknown fairness policy {policy!r}")
        self.policy = policy
        self.ordered = ordered
        self.bands: dict[int, Band] = {}
        self.requests = 0
        self.bytes = 0
        self._index: dict[int, QueueItem] = {}
        #: token-fair-share only: ``served`` of flows that emptied, so a flow that returns
        #: is not reset to 0; at most HISTORY_LIMIT entries, the oldest forgotten first.
        self.history: OrderedDict[tuple[int, str], float] = OrderedDict()

    def __len__(self) -> int:
        return self.requests

    def __contains__(self, item: QueueItem) -> bool:
        return item.id in self._index

    def band_size(self, priority: int) -> tuple[int, int]:
        band = self.bands.get(priority)
        return (band.requests, band.bytes) if band else (0, 0)

    def add(self, item: QueueItem) -> None:
        band = self.bands.get(item.priority)
        if band is None:
            band = self.bands[item.priority] = Band(item.priority)
            self.bands = dict(sorted(self.bands.items(), reverse=True))
        flow = band.flows.get(item.flow)
        if flow is None:
            flow = band.flows[item.flow] = Flow(item.flow)
            floor = min((f.served for f in band.flows.values() if f.items), default=0.0)
            flow.served = max(self.history.pop((item.priority, item.flow), 0.0), floor)
        if not flow.items:
            band.ring.append(item.flow)
        flow.items[item.id] = item
        if self.ordered:
            heapq.heappush(flow.heap, (item.order, item.id))
        flow.bytes += item.size
        band.requests += 1
        band.bytes += item.size
        self.requests += 1
        self.bytes += item.size
        self._index[item.id] = item

    def remove(self, item: QueueItem) -> bool:
        """Take ``item`` out wherever it is (client gone, TTL); False if already gone."""
        if self._index.pop(item.id, None) is None:
            return False
        band = self.bands[item.priority]
        flow = band.flows[item.flow]
        del flow.items[item.id]
        if self.ordered and len(flow.heap) > 2 * len(flow.items) + 16:
            flow.heap = [(i.order, i.id) for i in flow.items.values()]
            heapq.heapify(flow.heap)
        self._account_removed(band, flow, item)
        return True

    def pop(self) -> QueueItem | None:
        """The next request to dispatch: highest band, its policy's flow, its oldest (or
        least ``order``) request."""
        for band in self.bands.values():
            if band.requests:
                flow = self._next_flow(band)
                item = self._take(flow)
                del self._index[item.id]
                flow.served += item.cost_estimate
                self._account_removed(band, flow, item)
                return item
        return None

    def _take(self, flow: Flow) -> QueueItem:
        """The flow's next item, out of it: the oldest, or the least ``order``."""
        if not self.ordered:
            return flow.items.popitem(last=False)[1]
        while True:
            _, item_id = heapq.heappop(flow.heap)
            item = flow.items.pop(item_id, None)
            if item is not None:
                return item

    def peek_oldest(self) -> QueueItem | None:
        """The longest-waiting request of all (for the age gauge); O(flows)."""
        oldest: QueueItem | None = None
        for band in self.bands.values():
            for flow in band.flows.values():
                head = next(iter(flow.items.values()), None)
                if head is not None and (oldest is None or head.enqueued < oldest.enqueued):
                    oldest = head
        return oldest

    def charge(self, priority: int, fairness_id: str, tokens: float) -> None:
        """Correct a flow's ``served`` by ``tokens`` (actual usage minus the estimate)."""
        band = self.bands.get(priority)
        flow = band.flows.get(fairness_id) if band is not None else None
        if flow is not None:
            flow.served = max(0.0, flow.served + tokens)
        elif (priority, fairness_id) in self.history:
            key = (priority, fairness_id)
            self.history[key] = max(0.0, self.history[key] + tokens)

    def _next_flow(self, band: Band) -> Flow:
        if self.policy == "round-robin":
            name = band.ring.popleft()
            flow = band.flows[name]
            if len(flow.items) > 1:
                band.ring.append(name)  # its turn is used; back of the ring
            return flow
        flow = min((band.flows[name] for name in band.ring), key=lambda f: f.served)
        if len(flow.items) == 1:
            band.ring.remove(flow.fairness_id)
        return flow

    def _account_removed(self, band: Band, flow: Flow, item: QueueItem) -> None:
        flow.bytes -= item.size
        band.requests -= 1
        band.bytes -= item.size
        self.requests -= 1
        self.bytes -= item.size
        if not flow.items:
            if flow.fairness_id in band.ring:
                band.ring.remove(flow.fairness_id)
            if self.policy == "token-fair-share":
                self.history[(band.priority, flow.fairness_id)] = flow.served
                while len(self.history) > HISTORY_LIMIT:
                    self.history.popitem(last=False)
            del band.flows[flow.fairness_id]
        if not band.requests:
            del self.bands[band.priority]
        if not self.requests:
            self._index = {}  # a dict keeps its high-water capacity; a burst's is let go
