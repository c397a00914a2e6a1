"""Assertions shared by the conformance tests (GIE's helpers, in Python)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from conformance import topology as topo
from conformance.drivers.base import Driver, Reply
from conformance.kube import conditions_of, parent_entries, wait_for

#: ``status.parents[].controllerName`` of the entry the infergate operator writes.
OPERATOR_CONTROLLER = "infergate.io/operator"
#: Status codes GIE treats as "not converged yet" while retrying.
TRANSIENT = (404, 503)


def eventually(
    driver: Driver,
    route: str,
    *,
    expect: Callable[[Reply], bool],
    what: str,
    headers: Mapping[str, str] | None = None,
    body: Any = None,
    method: str = "POST",
    timeout: float | None = None,
) -> Reply:
    """Send until a reply meets ``expect`` (GIE: MakeRequestAndExpectEventuallyConsistentResponse)."""
    deadline = time.monotonic() + (timeout or driver.settle_timeout)
    last: Reply | None = None
    while True:
        last = driver.send(route, headers=headers, body=body, method=method)
        if expect(last):
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{route}: never got {what}; last reply: {last!r}")
        time.sleep(0.5)


def served_by(pod: str) -> Callable[[Reply], bool]:
    """Expectation: a 200 answered by ``pod``."""
    return lambda reply: reply.status == 200 and reply.pod == pod


def selection(*endpoints: str) -> dict[str, str]:
    return {topo.SELECTION_HEADER: ",".join(endpoints)}


def traffic_only_reaches(
    driver: Driver,
    route: str,
    headers: Mapping[str, str],
    allowed: Mapping[str, Collection[int]],
    *,
    total: int = 100,
    concurrency: int = 10,
) -> dict[str, int]:
    """Send ``total`` requests; each must be 200 from a pod in ``allowed`` (pod name →
    allowed ports, empty = any of its ports). Returns hits per ``pod:port``."""
    eventually(driver, route, headers=headers, expect=lambda r: r.status == 200, what="a 200")

    def one(_: int) -> Reply:
        reply = driver.send(route, headers=headers)
        for _attempt in range(20):  # GIE retries transient 404/503 for a converging gateway
            if reply.status not in TRANSIENT:
                break
            time.sleep(0.5)
            reply = driver.send(route, headers=headers)
        return reply

    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(one, range(total)))
    hits: dict[str, int] = {}
    for reply in replies:
        assert reply.status == 200, f"request failed: {reply!r}"
        pod = reply.pod or ""
        assert pod in allowed, f"served by unexpected pod {pod!r} (allowed {sorted(allowed)})"
        ports = allowed[pod]
        port = int(reply.echo.get("httpPort") or 0)
        if ports:
            assert port in ports, f"{pod} served on port {port}, allowed {sorted(ports)}"
        key = f"{pod}:{port}"
        hits[key] = hits.get(key, 0) + 1
    return hits


def operator_conditions(driver: Driver, name: str, namespace: str = topo.APP_NS) -> dict[str, Any]:
    pool = driver.kube.get("InferencePool", namespace, name)
    for entry in parent_entries(pool):
        if entry.get("controllerName") == OPERATOR_CONTROLLER:
            return conditions_of(entry)
    return {}


def gateway_conditions(
    driver: Driver, name: str, gateway: str, namespace: str = topo.APP_NS
) -> dict[str, Any]:
    pool = driver.kube.get("InferencePool", namespace, name)
    for entry in parent_entries(pool):
        ref = entry.get("parentRef") or {}
        if ref.get("kind", "Gateway") == "Gateway" and ref.get("name") == gateway:
            return conditions_of(entry)
    return {}


def wait_condition(
    driver: Driver,
    read: Callable[[], dict[str, Any]],
    type_: str,
    status: str,
    reason: str | Collection[str] | None = None,
    what: str = "",
) -> dict[str, Any]:
    """Wait until ``read()`` has condition ``type_`` with ``status`` (and ``reason``)."""
    reasons = {reason} if isinstance(reason, str) else set(reason or ())

    def probe() -> dict[str, Any] | None:
        cond = read().get(type_)
        if cond and cond.get("status") == status and (not reasons or cond.get("reason") in reasons):
            return dict(cond)
        return None

    return wait_for(
        probe,
        timeout=driver.settle_timeout,
        what=f"{what or 'condition'} {type_}={status}"
        + (f" ({'|'.join(sorted(reasons))})" if reasons else ""),
    )
