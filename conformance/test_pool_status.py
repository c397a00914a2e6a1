"""Pool status: ``Accepted`` and ``ResolvedRefs`` per parent, an invalid
``endpointPickerRef``, invalid ports, an HTTPRoute that names a missing pool
(GIE: InferencePoolAccepted, InferencePoolResolvedRefsCondition,
InferencePoolInvalidEPPService, InferencePoolMissingEPPRef,
InferencePoolHTTPRoutePortValidation, HTTPRouteInvalidInferencePoolRef).

Parents: the infergate operator reports every pool under its own parent
(``controllerName: infergate.io/operator``) — there is one even with no Gateway. A
Gateway API implementation adds one entry per Gateway whose routes use the pool; those
checks need the ``gateway-api`` capability (the cluster driver).

Where the operator differs from GIE's assumptions: GIE's EPP is deployed by the test
manifests, so a pool naming a missing Service has an unresolvable reference. infergate's
operator *deploys* the EPP behind the Service the reference names, so a missing Service
is created, not an error. An invalid reference for infergate is one it cannot serve: a
Service someone else owns without the referenced port, or a kind it does not manage.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

from conformance import topology as topo
from conformance.checks import (
    gateway_conditions,
    operator_conditions,
    wait_condition,
)
from conformance.drivers.base import GATEWAY_API, Driver, Reply
from conformance.kube import KubeError, wait_for

pytestmark = pytest.mark.conformance

NS = topo.APP_NS


def _needs_gateway_api(driver: Driver, what: str) -> None:
    if GATEWAY_API not in driver.capabilities:
        pytest.skip(
            f"{what} needs a Gateway API implementation; the {driver.name} driver runs none "
            "(each route is an Envoy configured directly); runs on kind (make conformance)"
        )


def _pool(name: str, **spec_changes: Any) -> dict[str, Any]:
    body = copy.deepcopy(topo.pools()[topo.PRIMARY_POOL].body)
    body["metadata"] = {"name": name, "namespace": NS}
    body["spec"].update(spec_changes)
    return body


def _route_conditions(driver: Driver, name: str) -> dict[str, Any]:
    """Conditions of an HTTPRoute's status entry for the primary Gateway."""
    route = driver.kube.get("HTTPRoute", NS, name) or {}
    for parent in (route.get("status") or {}).get("parents") or []:
        if parent.get("parentRef", {}).get("name") == topo.PRIMARY_GATEWAY:
            return {c["type"]: c for c in parent.get("conditions") or []}
    return {}


@pytest.fixture
def scratch(driver: Driver) -> Iterator[list[tuple[str, str]]]:
    """(kind, name) of objects a test creates; deleted afterwards."""
    created: list[tuple[str, str]] = []
    yield created
    for kind, name in reversed(created):
        driver.kube.delete(kind, NS, name)


@pytest.mark.conformance("InferencePoolAccepted")
def test_pool_is_accepted(driver: Driver) -> None:
    for pool in (topo.PRIMARY_POOL, topo.SECONDARY_POOL, topo.DP_POOL):
        cond = wait_condition(
            driver, partial(operator_conditions, driver, pool), "Accepted", "True",
            what=f"{pool}: operator parent",
        )  # fmt: skip
        assert cond["reason"] == "Accepted"
        body = driver.kube.get("InferencePool", NS, pool) or {}
        assert cond["observedGeneration"] == body["metadata"]["generation"]


@pytest.mark.conformance("InferencePoolAccepted")
def test_pool_is_accepted_by_its_gateway(driver: Driver) -> None:
    _needs_gateway_api(driver, "A per-Gateway pool parent status")
    wait_condition(
        driver, lambda: gateway_conditions(driver, topo.PRIMARY_POOL, topo.PRIMARY_GATEWAY),
        "Accepted", "True", what="primary pool: Gateway parent",
    )  # fmt: skip


@pytest.mark.conformance("InferencePoolResolvedRefsCondition")
def test_picker_reference_resolves(driver: Driver) -> None:
    for pool in (topo.PRIMARY_POOL, topo.DP_POOL):
        model = topo.pools()[pool]
        wait_condition(
            driver, partial(operator_conditions, driver, pool), "ResolvedRefs", "True",
            reason="ResolvedRefs", what=f"{pool}: operator parent",
        )  # fmt: skip
        service = wait_for(
            partial(driver.kube.get, "Service", NS, model.picker_service),
            timeout=driver.settle_timeout, what=f"Service {model.picker_service}",
        )  # fmt: skip
        assert model.picker_port in [p["port"] for p in service["spec"]["ports"]]


@pytest.mark.conformance("InferencePoolResolvedRefsCondition")
def test_gateway_parents_follow_httproutes(driver: Driver, scratch: list[tuple[str, str]]) -> None:
    """A route on a second Gateway adds that Gateway as a parent; deleting it removes it."""
    _needs_gateway_api(driver, "A per-Gateway pool parent status")
    route: dict[str, Any] = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "httproute-for-secondary-gw", "namespace": NS},
        "spec": {
            "parentRefs": [{"name": topo.SECONDARY_GATEWAY, "namespace": topo.INFRA_NS}],
            "hostnames": ["secondary.example.com"],
            "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/secondary-gateway-test"}}],
                       "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                        "name": topo.PRIMARY_POOL}]}],
        },
    }  # fmt: skip
    driver.kube.apply(route)
    scratch.append(("HTTPRoute", route["metadata"]["name"]))
    for gateway in (topo.PRIMARY_GATEWAY, topo.SECONDARY_GATEWAY):
        wait_condition(
            driver, partial(gateway_conditions, driver, topo.PRIMARY_POOL, gateway),
            "Accepted", "True", what=f"parent {gateway}",
        )  # fmt: skip
    driver.kube.delete("HTTPRoute", NS, route["metadata"]["name"])
    wait_for(
        lambda: not gateway_conditions(driver, topo.PRIMARY_POOL, topo.SECONDARY_GATEWAY),
        timeout=driver.settle_timeout, what="the secondary Gateway's parent entry to go",
    )  # fmt: skip
    assert gateway_conditions(driver, topo.PRIMARY_POOL, topo.PRIMARY_GATEWAY)


@pytest.mark.conformance("InferencePoolInvalidEPPService")
def test_service_without_the_picker_port(driver: Driver, scratch: list[tuple[str, str]]) -> None:
    """A Service infergate does not own, lacking the referenced port: ResolvedRefs=False."""
    driver.kube.apply(
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "someone-elses-picker", "namespace": NS},
         "spec": {"selector": {"app": "nothing"}, "ports": [{"name": "http", "port": 8080}]}}
    )  # fmt: skip
    scratch.append(("Service", "someone-elses-picker"))
    pool = _pool(
        "pool-with-invalid-epp",
        endpointPickerRef={"name": "someone-elses-picker", "port": {"number": 9002}},
    )
    driver.kube.apply(pool)
    scratch.append(("InferencePool", "pool-with-invalid-epp"))
    cond = wait_condition(
        driver, lambda: operator_conditions(driver, "pool-with-invalid-epp"), "ResolvedRefs", "False",
        what="pool-with-invalid-epp",
    )  # fmt: skip
    assert "9002" in cond["message"]
    # Nothing was deployed behind a Service the operator does not own.
    assert driver.kube.get("Deployment", NS, "someone-elses-picker") is None


@pytest.mark.conformance("InferencePoolInvalidEPPService")
def test_picker_of_an_unsupported_kind(driver: Driver, scratch: list[tuple[str, str]]) -> None:
    pool = _pool(
        "pool-with-foreign-epp",
        endpointPickerRef={
            "group": "example.com",
            "kind": "Picker",
            "name": "p",
            "port": {"number": 9002},
        },
    )
    driver.kube.apply(pool)
    scratch.append(("InferencePool", "pool-with-foreign-epp"))
    wait_condition(
        driver, lambda: operator_conditions(driver, "pool-with-foreign-epp"), "ResolvedRefs", "False",
        reason="InvalidExtensionRef", what="pool-with-foreign-epp",
    )  # fmt: skip


@pytest.mark.conformance("InferencePoolInvalidEPPService")
def test_request_through_an_unresolvable_picker_fails(
    driver: Driver, scratch: list[tuple[str, str]]
) -> None:
    """GIE: a route to a pool whose picker cannot be resolved answers 5xx (GIE's 'route
    accepted' precondition, then only 5xx once the Gateway has the route)."""
    _needs_gateway_api(driver, "Routing an HTTPRoute to a pool")
    driver.kube.apply(
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "unreachable-picker", "namespace": NS},
         "spec": {"selector": {"app": "nothing"}, "ports": [{"name": "http", "port": 8080}]}}
    )  # fmt: skip
    scratch.append(("Service", "unreachable-picker"))
    driver.kube.apply(_pool("pool-with-invalid-epp-service", endpointPickerRef={
        "name": "unreachable-picker", "port": {"number": 9002}}))  # fmt: skip
    scratch.append(("InferencePool", "pool-with-invalid-epp-service"))
    route = "httproute-for-invalid-epp-pool"
    driver.kube.apply(
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
         "metadata": {"name": route, "namespace": NS},
         "spec": {"parentRefs": [{"name": topo.PRIMARY_GATEWAY, "namespace": topo.INFRA_NS}],
                  "hostnames": ["invalid-epp.example.com"],
                  "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/invalid-epp-test"}}],
                             "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                              "name": "pool-with-invalid-epp-service"}]}]}}
    )  # fmt: skip
    scratch.append(("HTTPRoute", route))
    wait_condition(
        driver, partial(_route_conditions, driver, route), "Accepted", "True", what=route
    )

    def answered_5xx() -> Reply | None:
        reply = driver.send_to_gateway(
            topo.PRIMARY_GATEWAY, "invalid-epp.example.com", "/invalid-epp-test"
        )
        return reply if 500 <= reply.status < 600 else None

    reply = wait_for(answered_5xx, timeout=driver.settle_timeout, what="a 5xx", interval=1.0)
    assert reply.pod is None, reply


@pytest.mark.conformance("InferencePoolInvalidPorts")
@pytest.mark.parametrize(
    ("ports", "why"),
    [
        ([{"number": 3000}, {"number": 3000}], "duplicate targetPorts"),
        ([{"number": 3000 + i} for i in range(9)], "more than 8 targetPorts"),
        ([{"number": 0}], "port 0"),
        ([{"number": 70000}], "port above 65535"),
        ([], "no targetPorts"),
    ],
)
def test_invalid_target_ports_are_rejected(
    driver: Driver, ports: list[dict[str, int]], why: str
) -> None:
    with pytest.raises(KubeError) as rejected:
        driver.kube.apply(_pool("pool-with-invalid-ports", targetPorts=ports))
    assert rejected.value.status == 422, f"{why}: {rejected.value}"
    assert driver.kube.get("InferencePool", NS, "pool-with-invalid-ports") is None


@pytest.mark.conformance("InferencePoolInvalidPorts")
def test_picker_port_clashing_with_metrics(driver: Driver, scratch: list[tuple[str, str]]) -> None:
    """The picker port may not be the EPP's metrics port: not accepted, with the reason."""
    driver.kube.apply(_pool("pool-with-clashing-port", endpointPickerRef={
        "name": "clashing-picker-svc", "port": {"number": 9090}}))  # fmt: skip
    scratch.append(("InferencePool", "pool-with-clashing-port"))
    cond = wait_condition(
        driver, lambda: operator_conditions(driver, "pool-with-clashing-port"), "Accepted", "False",
        reason="InvalidExtensionRef", what="pool-with-clashing-port",
    )  # fmt: skip
    assert "9090" in cond["message"]


@pytest.mark.conformance("InferencePoolInvalidPorts")
def test_fixing_the_ports_makes_the_pool_accepted(
    driver: Driver, scratch: list[tuple[str, str]]
) -> None:
    name = "pool-with-fixed-port"
    driver.kube.apply(
        _pool(name, endpointPickerRef={"name": "fixed-picker-svc", "port": {"number": 9090}})
    )
    scratch.append(("InferencePool", name))
    wait_condition(
        driver, lambda: operator_conditions(driver, name), "Accepted", "False", what=name
    )
    driver.kube.apply(
        _pool(name, endpointPickerRef={"name": "fixed-picker-svc", "port": {"number": 9002}})
    )
    cond = wait_condition(
        driver, lambda: operator_conditions(driver, name), "Accepted", "True", what=name
    )
    assert cond["observedGeneration"] == 2


@pytest.mark.conformance("InferencePoolHTTPRoutePortValidation")
@pytest.mark.parametrize(
    "port", [None, 3000, 8080], ids=["unspecified", "matching", "non-matching"]
)
def test_httproute_backend_port_is_ignored(
    driver: Driver, scratch: list[tuple[str, str]], port: int | None
) -> None:
    """GIE: a backendRef port on an InferencePool is ignored; every variant routes."""
    _needs_gateway_api(driver, "Routing an HTTPRoute to a pool")
    ref: dict[str, Any] = {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": topo.PRIMARY_POOL,
    }
    if port is not None:
        ref["port"] = port
    name = f"httproute-pool-port-{port or 'unspecified'}"
    host = f"port-{port or 'unspecified'}.example.com"
    driver.kube.apply(
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
         "metadata": {"name": name, "namespace": NS},
         "spec": {"parentRefs": [{"name": topo.PRIMARY_GATEWAY, "namespace": topo.INFRA_NS}],
                  "hostnames": [host],
                  "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/test-port"}}],
                             "backendRefs": [ref]}]}}
    )  # fmt: skip
    scratch.append(("HTTPRoute", name))
    pod = driver.pods(topo.PRIMARY_POOL)[0]
    reply = driver.send_to_gateway(
        topo.PRIMARY_GATEWAY, host, "/test-port", headers={topo.SELECTION_HEADER: pod.ip}
    )
    assert reply.status == 200 and reply.pod == pod.name, reply


@pytest.mark.conformance("InferencePoolMissingEPPRef")
def test_pool_without_picker_reference_is_rejected(driver: Driver) -> None:
    body = _pool("pool-with-missing-epp-ref")
    del body["spec"]["endpointPickerRef"]
    with pytest.raises(KubeError) as rejected:
        driver.kube.apply(body)
    assert rejected.value.status == 422


@pytest.mark.conformance("HTTPRouteInvalidInferencePoolRef")
def test_httproute_to_a_missing_pool(driver: Driver, scratch: list[tuple[str, str]]) -> None:
    _needs_gateway_api(driver, "HTTPRoute status")
    name = "httproute-to-non-existent-pool"
    driver.kube.apply(
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
         "metadata": {"name": name, "namespace": NS},
         "spec": {"parentRefs": [{"name": topo.PRIMARY_GATEWAY, "namespace": topo.INFRA_NS}],
                  "rules": [{"backendRefs": [{"group": "inference.networking.k8s.io",
                                              "kind": "InferencePool", "name": "non-existent-pool"}]}]}}
    )  # fmt: skip
    scratch.append(("HTTPRoute", name))

    conditions = partial(_route_conditions, driver, name)
    wait_condition(driver, conditions, "Accepted", "True", reason="Accepted", what=name)
    wait_condition(driver, conditions, "ResolvedRefs", "False", reason="BackendNotFound", what=name)


@pytest.mark.conformance("InferencePoolReady")
def test_pool_with_a_running_picker_is_ready(driver: Driver) -> None:
    """infergate's third condition: Ready once the EPP Deployment is available, with the
    number of ready model-server pods the selector matches."""
    driver.picker_available(topo.PRIMARY_POOL)
    wait_condition(
        driver, lambda: operator_conditions(driver, topo.PRIMARY_POOL), "Ready", "True",
        reason="EndpointPickerAvailable", what="primary pool",
    )  # fmt: skip
    pool = driver.kube.get("InferencePool", NS, topo.PRIMARY_POOL) or {}
    entry = next(
        p for p in pool["status"]["parents"] if p.get("controllerName") == "infergate.io/operator"
    )
    assert entry.get("readyEndpoints") == len(driver.pods(topo.PRIMARY_POOL))
