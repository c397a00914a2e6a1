"""The scheduler's waiting queue under vLLM's two ``--scheduling-policy`` values.

``fcfs``: arrival order; a preempted request goes back to the head (it was admitted
before anything still waiting). ``priority``: ordered by ``(priority, arrival_time +
order_delay)``, a lower value first as in vLLM; ``order_delay`` (0 unless the EPP set
one) lets a short prefill overtake a long one that arrived shortly before. A preempted
request simply re-enters at its place in that order. Both keep the same small interface,
so the scheduler reads the same either way.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Literal

from infergate.engine.core.request import Request

SchedulingPolicy = Literal["fcfs", "priority"]
POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority")


def priority_key(request: Request) -> tuple[int, float]:
    """Lower runs first: the priority value, then the earlier arrival, delayed by the
    request's ``order_delay``."""
    return (request.priority, request.arrival_time + request.order_delay)


class WaitingQueue:
    def __init__(self, policy: SchedulingPolicy = "fcfs") -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        # fcfs: a deque in queue order. priority: a list kept sorted by priority_key
        # (inserting costs O(n), which is nothing next to a model step).
        self._fcfs: deque[Request] = deque()
        self._sorted: list[Request] = []

    @property
    def _items(self) -> deque[Request] | list[Request]:
        return self._fcfs if self.policy == "fcfs" else self._sorted

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def add(self, request: Request) -> None:
        """A new arrival: the tail (fcfs) or its place by priority."""
        if self.policy == "fcfs":
            self._fcfs.append(request)
        else:
            bisect.insort(self._sorted, request, key=priority_key)

    def requeue(self, requests: Iterable[Request]) -> None:
        """Requests that were at the head (preempted, or skipped this step), in their
        order: back to the head (fcfs) or to their place by priority."""
        if self.policy == "fcfs":
            self._fcfs.extendleft(reversed(list(requests)))
        else:
            for request in requests:
                bisect.insort(self._sorted, request, key=priority_key)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._fcfs.popleft() if self.policy == "fcfs" else self._sorted.pop(0)

    def remove(self, request: Request) -> None:
        """Unlink ``request``; ValueError when it is not queued."""
        self._items.remove(request)
