"""The lost-record sweep (``server/record_sweep.py``) runs while requests are in flight
only, and a replica that routes sweeps on its decisions' refreshes, not on a timer.

An idle replica used to sweep every second for nothing, and a routing one on a timer
of its own: wakeups every replica paid (docs/benchmarks/scale.md, "Replicas"). Counted,
not timed: sweeps while idle, which sweeps the refreshes ran, and a lost record still
given up once a request is in flight.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from infergate.epp.datalayer.completions import COMPLETION_EVENTS_PORT_LABEL
from infergate.epp.server.record_sweep import PIGGYBACK_S, SWEEP_S, RecordSweep
from infergate.epp.types import Endpoint

from infergate.procs import free_port

from .conftest import eventually, route_answered

#: Several sweep periods (1 s each).
IDLE_S = 2.5


async def test_an_idle_replica_does_not_sweep_and_a_lost_record_is_still_given_up(
    epp_factory: Any, channel_for: Any, engine_metrics: Any, monkeypatch: Any
) -> None:
    metrics = engine_metrics()  # an engine that runs nothing: a routed response is over
    metrics.set(0, 0, 0.0)
    # Labelled as reporting completions on a port where nothing publishes: records are lost.
    labels = ((COMPLETION_EVENTS_PORT_LABEL, str(free_port())),)
    epp = await epp_factory(static_endpoints=[Endpoint("127.0.0.1", metrics.port, labels)])
    sweeps = 0
    expire = epp.ext_proc.expire_records

    def counted(now: float, gone: str | None = None) -> int:
        nonlocal sweeps
        sweeps += gone is None
        return expire(now, gone)

    monkeypatch.setattr(epp.ext_proc, "expire_records", counted)
    await asyncio.sleep(IDLE_S)
    assert sweeps <= 1  # the first sweep finds nothing in flight and waits

    idle = sweeps
    await route_answered(epp, channel_for(epp))
    lost = epp.metrics.requests.labels("record_lost")
    before = lost._value.get()
    await eventually(lambda: not epp.ext_proc.awaiting, timeout=15)  # the sweep gave it up
    assert lost._value.get() == before + 1
    assert sweeps > idle


async def test_refreshes_sweep_in_the_timers_place_and_a_quiet_one_is_timed() -> None:
    """Refreshes (decisions) every 0.05 s for 3 s run the sweeps, just after the refresh
    that finds it nearly due; with none, the timer sweeps while something is in flight
    and stops once nothing is."""
    swept: list[float] = []
    flying = [False]

    def expire(now: float) -> int:
        swept.append(now)
        return 0

    sweep = RecordSweep(expire, lambda: flying[0])
    try:
        sweep.on_refresh()  # nothing in flight: no timer
        await asyncio.sleep(SWEEP_S + 0.3)
        assert swept == []

        flying[0] = True
        for _ in range(60):
            sweep.on_refresh()
            await asyncio.sleep(0.05)
        # ~ one per SWEEP_S - PIGGYBACK_S; the timer would need a 0.45 s gap between refreshes
        assert sweep.piggybacked >= 3
        assert sweep.timed == 0
        assert all(b - a >= SWEEP_S - PIGGYBACK_S for a, b in itertools.pairwise(swept))

        await eventually(lambda: sweep.timed >= 1, timeout=5)  # no refresh: the timer
        flying[0] = False
        await eventually(lambda: not sweep.armed, timeout=5)  # nothing in flight
        count = len(swept)
        await asyncio.sleep(SWEEP_S + 0.3)
        assert len(swept) == count
    finally:
        sweep.close()


async def test_a_sweep_that_raises_does_not_stop_the_next() -> None:
    """A bug in giving records up (an exception from ``expire``) is logged by the loop,
    and the timer still runs the next sweep while requests are in flight."""
    calls: list[float] = []

    def expire(now: float) -> int:
        calls.append(now)
        if len(calls) == 1:
            raise RuntimeError("a sink's bug")
        return 0

    sweep = RecordSweep(expire, lambda: True)
    try:
        sweep.on_refresh()  # in flight: the timer is armed
        await eventually(lambda: len(calls) >= 2, timeout=5)
        assert sweep.timed >= 2
    finally:
        sweep.close()
