"""EPP unavailable: a FailOpen pool keeps serving, a FailClose pool fails
(GIE: EppUnAvailableFailOpen; FailClose is the API's default and the other half)."""

from __future__ import annotations

import pytest

from conformance import topology as topo
from conformance.checks import eventually, selection
from conformance.drivers.base import Driver

pytestmark = pytest.mark.conformance


@pytest.mark.conformance("EppUnAvailableFailOpen")
def test_fail_open_pool_keeps_serving(driver: Driver) -> None:
    pods = driver.pods(topo.SECONDARY_POOL)
    names = {p.name for p in pods}
    target = pods[0]
    # Phase 1: with the EPP up, the pinned pod serves.
    eventually(
        driver, "failopen", headers=selection(target.ip),
        expect=lambda r: r.status == 200 and r.pod == target.name, what=f"a 200 from {target.name}",
    )  # fmt: skip
    # Phase 2: EPP gone; requests still succeed, from some pod of the pool.
    with driver.epp_unavailable(topo.SECONDARY_POOL):
        # A request without a body first (the EPP would route it at header time).
        eventually(
            driver, "failopen", method="GET", headers=selection(target.ip),
            expect=lambda r: r.status == 200 and r.pod in names, what="a 200 (GET) without the EPP",
        )  # fmt: skip
        for _ in range(10):
            reply = driver.send("failopen", method="GET", headers=selection(target.ip))
            assert reply.status == 200 and reply.pod in names, reply
        # GIE's request: a POST with an OpenAI body, eventually served, then always.
        eventually(
            driver, "failopen", headers=selection(target.ip),
            expect=lambda r: r.status == 200 and r.pod in names, what="a 200 (POST) without the EPP",
        )  # fmt: skip
        replies = [driver.send("failopen", headers=selection(target.ip)) for _ in range(20)]
    failed = [r for r in replies if r.status != 200 or r.pod not in names]
    assert not failed, failed
    # The EPP is back: routing follows it again.
    eventually(
        driver, "failopen", headers=selection(pods[1].ip),
        expect=lambda r: r.status == 200 and r.pod == pods[1].name, what="EPP routing again",
    )  # fmt: skip


@pytest.mark.conformance("EppUnAvailableFailClose")
def test_fail_close_pool_fails(driver: Driver) -> None:
    pods = driver.pods(topo.PRIMARY_POOL)
    eventually(
        driver, "primary", headers=selection(pods[0].ip),
        expect=lambda r: r.status == 200, what="a 200 with the EPP up",
    )  # fmt: skip
    with driver.epp_unavailable(topo.PRIMARY_POOL):
        eventually(
            driver, "primary", headers=selection(pods[0].ip),
            expect=lambda r: r.status >= 500, what="a 5xx without the EPP",
        )  # fmt: skip
        for _ in range(10):
            reply = driver.send("primary", headers=selection(pods[0].ip))
            assert reply.status >= 500 and reply.pod is None, reply
    eventually(
        driver, "primary", headers=selection(pods[1].ip),
        expect=lambda r: r.status == 200 and r.pod == pods[1].name, what="EPP routing again",
    )  # fmt: skip
