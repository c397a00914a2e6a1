"""Envoy's health checks run the data layer's housekeeping first (epp/server/health.py);
a check answers whatever that housekeeping does."""

from __future__ import annotations

import pytest
from grpc_health.v1 import health_pb2
from infergate.epp.server.health import HousekeepingHealth


async def test_each_check_runs_housekeeping_and_a_failing_one_does_not_fail_the_check(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[int] = []

    def housekeep() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a feed's bug")

    health = HousekeepingHealth(housekeep)
    await health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    request = health_pb2.HealthCheckRequest(service="liveness")
    replies = [await health.Check(request, context=None) for _ in range(3)]
    assert [r.status for r in replies] == [health_pb2.HealthCheckResponse.SERVING] * 3
    assert len(calls) == 3
    assert "housekeeping at a health check failed" in caplog.text
