"""The lost-record sweep: give up completion records that will not come, once a second
while anything is in flight, mostly without a wakeup of its own.

A response's record can be lost (PUB/SUB drops what a subscriber was not connected
for, an engine dies), so the EPP gives up waiting (``ExtProcServer.expire_records``):
past a request's record deadline, or once its engine's counts show it finished. Done
every :data:`SWEEP_S` by a timer, that was a wakeup a second for every replica with a
request in flight (docs/benchmarks/scale.md, "Replicas": a replica of four woke on a
timer 13 times in a row with it, 7 without).

So the sweep rides on the datastore's refresh, which runs right before each decision,
as the push watch does (``collector._PushWatch``): a refresh within :data:`PIGGYBACK_S`
of the timer's time sweeps in its place (just after the decision, ``call_soon``: the
decision's own code does not change the requests it is routing among) and the timer
moves a period on. A replica that routes is not woken for the sweep; one that has
stopped routing with requests in flight still is, every :data:`SWEEP_S`; one with
nothing in flight has no timer until a refresh finds something in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from infergate.epp.datalayer.collector import PIGGYBACK_S

#: The sweep's period while requests are in flight, in seconds.
SWEEP_S = 1.0


class RecordSweep:
    """Calls ``expire(now)`` every :data:`SWEEP_S` while ``in_flight()``; its
    :meth:`on_refresh` is a datastore refresher (see the module docstring)."""

    def __init__(self, expire: Callable[[float], int], in_flight: Callable[[], bool]) -> None:
        self.expire = expire
        self.in_flight = in_flight
        #: Sweeps its own timer ran, and those a refresh ran in the timer's place.
        self.timed = 0
        self.piggybacked = 0
        self._handle: asyncio.Handle | None = None
        self._due = 0.0  # the loop time the timer fires at
        self._soon = False  # a piggybacked sweep waits in call_soon

    @property
    def armed(self) -> bool:
        """Whether a sweep is scheduled (its timer, or a refresh's ``call_soon``)."""
        return self._handle is not None

    def on_refresh(self) -> None:
        """A decision (or the collector) read the datastore: arm the timer if something
        went in flight since the last sweep, or sweep now if the timer is due within
        :data:`PIGGYBACK_S`."""
        loop = asyncio.get_running_loop()
        if self._handle is None:
            if self.in_flight():
                self._arm(loop, loop.time() + SWEEP_S)
            return
        if self._soon or loop.time() < self._due - PIGGYBACK_S:
            return
        self._handle.cancel()
        self._soon = True
        self._handle = loop.call_soon(self._sweep)

    def _arm(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        self._due = due
        self._handle = loop.call_at(due, self._sweep)

    def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        if self._soon:
            self.piggybacked += 1
        else:
            self.timed += 1
        self._soon = False
        self._handle = None
        now = loop.time()
        try:
            self.expire(now)  # what it raises, the loop's handler logs
        finally:
            if self.in_flight():  # the sweep goes on past a failed one
                self._arm(loop, now + SWEEP_S)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
