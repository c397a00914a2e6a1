"""GIE's conformance helpers, in Python, with the same rules: what a status must show
(conditions per parent, observedGeneration current), what a response must show (status,
path, method, host, namespace, pod-name prefix, response headers) and how long to retry
(eventual consistency: several successes in a row)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from conformance import topology as topo
from conformance.drivers.base import ENDPOINT_SLICES, Driver, Pod, Reply, Request
from conformance.kube import conditions_of, parent_entries, wait_for

#: Gateway API's defaults: a response must be as expected this many times in a row.
REQUIRED_CONSECUTIVE_SUCCESSES = 3
POLL_INTERVAL = 1.0
#: Status codes GIE treats as "not converged yet" while it sends its request bursts.
TRANSIENT = (404, 503)


@dataclass(frozen=True)
class Expected:
    """GIE's ``gwhttp.ExpectedResponse``: the status codes, headers the response must
    carry, and (for a 200) the backend pod's name prefix and namespace."""

    statuses: tuple[int, ...] = (200,)
    headers: Mapping[str, str] = field(default_factory=dict)
    backend: str = ""
    namespace: str = topo.APP_NS
    #: The protocol the model server saw (echo's ``proto``): infergate's own check.
    proto: str = ""


def mismatch(request: Request, reply: Reply, expected: Expected) -> str | None:
    """Why ``reply`` is not what ``expected`` says (None: it is); GIE's CompareRoundTrip."""
    if reply.status not in expected.statuses:
        return f"status {reply.status}, expected one of {list(expected.statuses)}"
    if reply.status not in (200, 204):
        return None
    echo = reply.echo
    checks = [
        ("path", request.path, echo.get("path")),
        ("method", request.method, echo.get("method")),
        ("namespace", expected.namespace, echo.get("namespace")),
    ]
    if request.host:
        checks.append(("host", request.host, echo.get("host")))
    if expected.proto:
        checks.append(("proto", expected.proto, echo.get("proto")))
    for what, want, got in checks:
        if want != got:
            return f"{what} {got!r}, expected {want!r}"
    for name, value in expected.headers.items():
        if reply.headers.get(name.lower()) != value:
            return f"header {name}: {reply.headers.get(name.lower())!r}, expected {value!r}"
    if not str(echo.get("pod") or "").startswith(expected.backend):
        return f"pod {echo.get('pod')!r} does not start with {expected.backend!r}"
    return None


def eventually(
    driver: Driver,
    address: str,
    request: Request,
    expected: Expected,
    timeout: float | None = None,
    *,
    skip: Callable[[Reply], bool] | None = None,
) -> Reply:
    """GIE's MakeRequestAndExpectEventuallyConsistentResponse: until the response is as
    expected :data:`REQUIRED_CONSECUTIVE_SUCCESSES` times in a row.

    A reply for which ``skip`` is true neither counts nor breaks the streak: behind a
    weighted split, a request the split sent to another pool says nothing of this one."""
    deadline = time.monotonic() + (timeout or driver.settle_timeout)
    streak, why = 0, ""
    while True:
        skipped = False
        try:
            reply = driver.send(address, request)
            skipped = skip is not None and skip(reply)
            why = "" if skipped else mismatch(request, reply, expected) or ""
        except httpx.TransportError as error:  # not listening yet, reset, timed out
            why = f"request failed: {error!r}"
        if not skipped:
            streak = 0 if why else streak + 1
        if streak >= REQUIRED_CONSECUTIVE_SUCCESSES:
            return reply
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{request.host}{request.path} at {address}: never as expected: {why}"
            )
        if why:
            time.sleep(POLL_INTERVAL)


def post(path: str, host: str = "", selection: str | None = None, body: Any = None) -> Request:
    """A POST with GIE's OpenAI body, optionally naming the endpoints the EPP may pick."""
    headers = {topo.SELECTION_HEADER: selection} if selection is not None else {}
    return Request(path, host, "POST", topo.REQUEST_BODY if body is None else body, headers)


def traffic_only_reaches(
    driver: Driver,
    address: str,
    request: Request,
    allowed: Mapping[str, Collection[int]],
    *,
    total: int = 100,
    concurrency: int = 10,
) -> dict[str, int]:
    """GIE's assertTrafficOnlyReachesToExpectedPods (and its DP variant): ``total``
    requests, ``concurrency`` at a time, each retried while 404/503 (up to 2 min); every
    one must be a 200 from a pod in ``allowed`` (name → allowed ports; empty: any).
    Returns hits per ``pod:port``."""
    eventually(driver, address, request, Expected(backend=""))

    def one(_: int) -> Reply:
        deadline = time.monotonic() + 120
        reply = driver.send(address, request)
        while reply.status in TRANSIENT and time.monotonic() < deadline:
            time.sleep(0.5)
            reply = driver.send(address, request)
        return reply

    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(one, range(total)))
    hits: dict[str, int] = {}
    for reply in replies:
        assert reply.status == 200, f"request failed: {reply!r}"
        pod = reply.pod or ""
        assert pod in allowed, f"served by unexpected pod {pod!r} (allowed {sorted(allowed)})"
        port = int(reply.echo.get("httpPort") or 0)
        if allowed[pod]:
            assert port in allowed[pod], (
                f"{pod} served on port {port}, allowed {sorted(allowed[pod])}"
            )
        hits[f"{pod}:{port}"] = hits.get(f"{pod}:{port}", 0) + 1
    return hits


# -- status ------------------------------------------------------------------------------
def _matches(conditions: Mapping[str, Any], wanted: Sequence[tuple[str, str, str]]) -> bool:
    for type_, status, reason in wanted:
        cond = conditions.get(type_)
        if cond and cond.get("status") == status and (not reason or cond.get("reason") == reason):
            return True
    return False


def route_conditions(driver: Driver, route: str, gateway: str) -> dict[str, Any] | None:
    """The HTTPRoute's conditions for ``gateway``; None while any parent entry's
    observedGeneration lags the route's generation (GIE waits for that too)."""
    body = driver.kube.get("HTTPRoute", topo.APP_NS, route) or {}
    generation = body.get("metadata", {}).get("generation")
    found: dict[str, Any] = {}
    for parent in (body.get("status") or {}).get("parents") or []:
        conditions = parent.get("conditions") or []
        if any(c.get("observedGeneration") != generation for c in conditions):
            return None
        ref = parent.get("parentRef") or {}
        if ref.get("name") == gateway and ref.get("namespace", topo.INFRA_NS) == topo.INFRA_NS:
            found.update(conditions_of(parent))
    return found


def route_must_have(
    driver: Driver, route: str, gateway: str, type_: str, status: str, reason: str = ""
) -> None:
    """GIE (Gateway API): HTTPRouteMustHaveCondition."""
    wait_for(
        lambda: _matches(route_conditions(driver, route, gateway) or {}, [(type_, status, reason)]),
        timeout=driver.settle_timeout,
        what=f"HTTPRoute {route} on {gateway}: {type_}={status} {reason}".rstrip(),
    )


def route_must_be_accepted_and_resolved(driver: Driver, route: str, gateway: str) -> None:
    """GIE: HTTPRouteMustBeAcceptedAndResolved."""
    route_must_have(driver, route, gateway, "Accepted", "True", "Accepted")
    route_must_have(driver, route, gateway, "ResolvedRefs", "True", "ResolvedRefs")


def pool_parent_conditions(driver: Driver, pool: str, gateway: str) -> dict[str, Any]:
    """The pool's conditions under the Gateway parent (GIE matches namespace and name)."""
    body = driver.kube.get("InferencePool", topo.APP_NS, pool)
    for entry in parent_entries(body):
        ref = entry.get("parentRef") or {}
        if ref.get("namespace") == topo.INFRA_NS and ref.get("name") == gateway:
            return conditions_of(entry)
    return {}


def pool_must_have_one_of(
    driver: Driver, pool: str, gateway: str, wanted: Sequence[tuple[str, str, str]]
) -> None:
    """GIE: InferencePoolMustHaveOneOfConditions (reason "" = any)."""
    wait_for(
        lambda: _matches(pool_parent_conditions(driver, pool, gateway), wanted),
        timeout=driver.settle_timeout, what=f"InferencePool {pool} under {gateway}: one of {wanted}",
    )  # fmt: skip


def pool_must_be_accepted_by(driver: Driver, pool: str, gateway: str) -> None:
    """GIE: InferencePoolMustBeAcceptedByParent (reason Accepted)."""
    pool_must_have_one_of(driver, pool, gateway, [("Accepted", "True", "Accepted")])


def pool_must_have_no_parents(driver: Driver, pool: str) -> None:
    """GIE: InferencePoolMustHaveNoParents."""
    wait_for(
        lambda: not parent_entries(driver.kube.get("InferencePool", topo.APP_NS, pool)),
        timeout=driver.settle_timeout, what=f"InferencePool {pool} to have no parents",
    )  # fmt: skip


# -- objects -----------------------------------------------------------------------------
@contextlib.contextmanager
def applied(driver: Driver, test: str) -> Iterator[list[dict[str, Any]]]:
    """A test's own manifests, applied for the test and deleted after it (GIE's suite
    applies each test's Manifests and cleans them up)."""
    objects = topo.manifest_of(test)
    driver.kube.apply_all(objects)
    try:
        yield objects
    finally:
        for obj in reversed(objects):
            meta = obj["metadata"]
            driver.kube.delete(obj["kind"], meta.get("namespace"), meta["name"])
        for obj in objects:
            _wait_gone(
                driver, obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"]
            )


def _wait_gone(driver: Driver, kind: str, namespace: str | None, name: str) -> None:
    wait_for(
        lambda: driver.kube.get(kind, namespace, name) is None,
        timeout=driver.settle_timeout, what=f"{kind} {name} deleted",
    )  # fmt: skip


def pods(driver: Driver, app: str) -> list[Pod]:
    """GIE: GetPodsWithLabel (running, with an IP), sorted by name; ports from the
    containers' declared ports."""

    def running() -> list[Pod] | None:
        found = []
        for pod in driver.kube.list("Pod", topo.APP_NS, {"app": app}):
            status = pod.get("status") or {}
            if pod["metadata"].get("deletionTimestamp"):
                continue
            if status.get("phase") != "Running" or not status.get("podIP"):
                return None
            ports = sorted(
                {
                    int(p["containerPort"])
                    for c in pod["spec"]["containers"]
                    for p in c.get("ports") or []
                }
            )
            found.append(Pod(pod["metadata"]["name"], status["podIP"], tuple(ports)))
        return sorted(found, key=lambda p: p.name) or None

    return wait_for(running, timeout=driver.settle_timeout, what=f"running pods of {app}")


@contextlib.contextmanager
def service_unavailable(driver: Driver, name: str, namespace: str = topo.APP_NS) -> Iterator[None]:
    """GIE: MakeServiceUnavailable — the Service selects nothing until the block ends.
    GIE then waits for the Service's EndpointSlices to empty (and refill), and so does
    this where the driver's cluster fills them (ENDPOINT_SLICES: the node and kind); on
    the control-plane driver the slices stay empty (the API refuses loopback endpoint
    addresses), so it waits for the pods the selector picks, which the slices would list."""
    service = driver.kube.get("Service", namespace, name)
    assert service is not None, f"Service {namespace}/{name} does not exist"
    selector = dict(service["spec"].get("selector") or {})
    wait = _wait_sliced if ENDPOINT_SLICES in driver.capabilities else _wait_selected
    _set_selector(driver, service, {"app": "do-not-match-for-testing"})
    try:
        wait(driver, namespace, name, lambda n: n == 0)
        yield
    finally:
        _set_selector(driver, service, selector)
        wait(driver, namespace, name, lambda n: n >= 1)


def _set_selector(driver: Driver, service: dict[str, Any], selector: dict[str, str]) -> None:
    meta = service["metadata"]
    driver.kube.apply(
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
         "spec": {"selector": selector, "ports": service["spec"]["ports"]}}
    )  # fmt: skip


def _wait_sliced(driver: Driver, namespace: str, name: str, ok: Callable[[int], bool]) -> None:
    """Until the addresses in the Service's EndpointSlices number ``ok``."""

    def count() -> bool:
        slices = driver.kube.list("EndpointSlice", namespace, {"kubernetes.io/service-name": name})
        return ok(
            sum(len(e.get("addresses") or []) for s in slices for e in s.get("endpoints") or [])
        )

    wait_for(count, timeout=driver.settle_timeout, what=f"the EndpointSlices of Service {name}")


def _wait_selected(driver: Driver, namespace: str, name: str, ok: Callable[[int], bool]) -> None:
    def count() -> bool:
        service = driver.kube.get("Service", namespace, name) or {}
        selector = (service.get("spec") or {}).get("selector") or {}
        return ok(len(driver.kube.list("Pod", namespace, selector)) if selector else 0)

    wait_for(count, timeout=driver.settle_timeout, what=f"the pods Service {name} selects")
