"""The lost-record sweep (``Epp._expire_records``) runs while requests are in flight only.

An idle replica used to sweep every second for nothing, a wakeup every replica paid
(docs/benchmarks/scale.md, "Replicas"). Counted, not timed: sweeps while idle, and a lost
record still given up once a request is in flight.
"""

from __future__ import annotations

import asyncio
from typing import Any

from infergate.epp.datalayer.completions import COMPLETION_EVENTS_PORT_LABEL
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
