"""An endpoint known dead releases the in-flight count of the requests the EPP sent it.

A SIGKILLed engine sends no completion records, so its answered requests would wait for
theirs until the records' deadline (330 s), counted in flight all along. The collector
knows the endpoint is dead when its metrics port refuses connections (or its snapshot
goes stale while scrapes fail); the EPP then gives the records up at once.

A real metrics server stands for the engine; the ext-proc stream is driven by hand.
"""

from __future__ import annotations

from collections.abc import Callable

from infergate.epp.datalayer.completions import COMPLETION_EVENTS_PORT_LABEL
from infergate.epp.types import Endpoint

from infergate.procs import free_port

from .conftest import EngineMetrics, eventually, route_answered


async def test_a_dead_endpoints_in_flight_count_is_cleared(
    engine_metrics: Callable[[], EngineMetrics], epp_factory, channel_for
) -> None:
    server = engine_metrics()
    server.set(0, 1, 0.1)  # the engine says one request runs: the record is not given up
    # Labelled as reporting completions, on a port where nothing publishes.
    engine = Endpoint("127.0.0.1", server.port, ((COMPLETION_EVENTS_PORT_LABEL, str(free_port())),))
    epp = await epp_factory(static_endpoints=[engine])
    state = epp.datastore.get(engine.key)
    assert state is not None
    await eventually(lambda: state.metrics.updated_at > 0, timeout=30)

    # One request routed there and answered 200: it waits for its completion record.
    await route_answered(epp, channel_for(epp))
    assert state.in_flight_requests == 1

    # Alive and scraped: the request stays counted.
    scrapes = epp.collectors.scrapes
    await eventually(lambda: epp.collectors.scrapes >= scrapes + 10, timeout=30)
    assert state.in_flight_requests == 1
    assert len(epp.ext_proc.awaiting) == 1

    # The engine dies (its port now refuses): the count is released, the record given up.
    server.close()
    await eventually(lambda: state.in_flight_requests == 0, timeout=10)
    assert not epp.ext_proc.awaiting
    assert epp.metrics.requests.labels("record_lost")._value.get() == 1
