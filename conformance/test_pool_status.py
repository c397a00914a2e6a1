"""Statuses: the pool's parent entry per Gateway (Accepted, ResolvedRefs) as HTTPRoutes
come and go, a picker Service that does not exist, a pool without endpointPickerRef, an
HTTPRoute to a missing pool, backendRef ports on a pool (GIE: InferencePoolAccepted,
InferencePoolResolvedRefsCondition, InferencePoolInvalidEPPService,
InferencePoolMissingEPPRef, HTTPRouteInvalidInferencePoolRef,
InferencePoolHTTPRoutePortValidation) and the API's port validation (infergate's
InferencePoolInvalidPorts)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import pytest

from conformance import topology as topo
from conformance.checks import (
    Expected,
    applied,
    eventually,
    pool_must_be_accepted_by,
    pool_must_have_no_parents,
    pool_must_have_one_of,
    route_must_be_accepted_and_resolved,
    route_must_have,
)
from conformance.drivers.base import Driver, Request
from conformance.kube import KubeError

pytestmark = pytest.mark.conformance

NS = topo.APP_NS
SERVER_ERRORS = (500, 501, 502, 503, 504)


@pytest.mark.conformance("InferencePoolAccepted")
def test_pool_is_accepted_by_its_gateway(driver: Driver) -> None:
    with applied(driver, "inferencepool_accepted"):
        pool_must_have_one_of(
            driver, topo.PRIMARY_POOL, topo.PRIMARY_GATEWAY, [("Accepted", "True", "")]
        )


@pytest.mark.conformance("InferencePoolResolvedRefsCondition")
def test_gateway_parents_follow_httproutes(
    driver: Driver, primary_address: str, secondary_address: str
) -> None:
    """Two routes on two Gateways to one pool: a parent per Gateway, both routable;
    delete one route: its Gateway's parent goes and its path answers 404; delete the
    other: no parent is left and nothing answers."""
    primary = Request("/primary-gateway-test", "primary.example.com")
    secondary = Request("/secondary-gateway-test", "secondary.example.com")
    with applied(driver, "inferencepool_resolvedrefs_condition"):
        route_must_be_accepted_and_resolved(
            driver, "httproute-for-primary-gw", topo.PRIMARY_GATEWAY
        )
        route_must_be_accepted_and_resolved(
            driver, "httproute-for-secondary-gw", topo.SECONDARY_GATEWAY
        )
        for gateway in (topo.PRIMARY_GATEWAY, topo.SECONDARY_GATEWAY):
            pool_must_be_accepted_by(driver, topo.PRIMARY_POOL, gateway)
        eventually(driver, primary_address, primary, Expected(backend=topo.PRIMARY_DEPLOYMENT))
        eventually(driver, secondary_address, secondary, Expected(backend=topo.PRIMARY_DEPLOYMENT))

        driver.kube.delete("HTTPRoute", NS, "httproute-for-primary-gw")
        pool_must_be_accepted_by(driver, topo.PRIMARY_POOL, topo.SECONDARY_GATEWAY)
        eventually(driver, secondary_address, secondary, Expected(backend=topo.PRIMARY_DEPLOYMENT))
        eventually(driver, primary_address, primary, Expected(statuses=(404,)))

        driver.kube.delete("HTTPRoute", NS, "httproute-for-secondary-gw")
        pool_must_have_no_parents(driver, topo.PRIMARY_POOL)
        eventually(driver, secondary_address, secondary, Expected(statuses=(404,)))


@pytest.mark.conformance("InferencePoolInvalidEPPService")
def test_picker_service_that_does_not_exist(driver: Driver, primary_address: str) -> None:
    """The route is accepted, the pool's Gateway parent says ResolvedRefs=False, and a
    request answers 5xx."""
    with applied(driver, "inferencepool_invalid_epp_service"):
        route_must_have(
            driver,
            "httproute-for-invalid-epp-pool",
            topo.PRIMARY_GATEWAY,
            "Accepted",
            "True",
            "Accepted",
        )
        pool_must_have_one_of(
            driver, "pool-with-invalid-epp", topo.PRIMARY_GATEWAY, [("ResolvedRefs", "False", "")]
        )
        eventually(
            driver, primary_address, Request("/invalid-epp-test"), Expected(statuses=SERVER_ERRORS)
        )


def _pool(name: str, **spec_changes: Any) -> dict[str, Any]:
    body = copy.deepcopy(topo.pools()[topo.PRIMARY_POOL].body)
    body["metadata"] = {"name": name, "namespace": NS}
    body["spec"].update(spec_changes)
    return body


def _route(name: str, pool: str, path: str) -> dict[str, Any]:
    return {
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"parentRefs": [{"name": topo.PRIMARY_GATEWAY, "namespace": topo.INFRA_NS}],
                 "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": path}}],
                            "backendRefs": [{"group": "inference.networking.k8s.io",
                                             "kind": "InferencePool", "name": pool}]}]},
    }  # fmt: skip


@contextlib.contextmanager
def _objects(driver: Driver, *objects: dict[str, Any]) -> Iterator[None]:
    for obj in objects:
        driver.kube.apply(obj)
    try:
        yield
    finally:
        for obj in reversed(objects):
            driver.kube.delete(obj["kind"], NS, obj["metadata"]["name"])


@pytest.mark.conformance("InferencePoolInvalidEPPService")
@pytest.mark.parametrize("case", ["service without the port", "unsupported picker kind"])
def test_other_unresolvable_pickers(driver: Driver, primary_address: str, case: str) -> None:
    """infergate's additions: a picker Service that lacks the referenced port, and a
    picker reference of a kind that is not a Service, are unresolved too."""
    name, path = f"pool-{case.replace(' ', '-')}", f"/{case.replace(' ', '-')}"
    if case == "service without the port":
        service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "picker-without-9002", "namespace": NS},
                   "spec": {"selector": {"app": "nothing"}, "ports": [{"name": "http", "port": 8080}]}}  # fmt: skip
        ref = {"name": "picker-without-9002", "port": {"number": 9002}}
        objects = [service, _pool(name, endpointPickerRef=ref)]
    else:
        ref = {"group": "example.com", "kind": "Picker", "name": "p", "port": {"number": 9002}}
        objects = [_pool(name, endpointPickerRef=ref)]
    with _objects(driver, *objects, _route(f"route-to-{name}", name, path)):
        route_must_have(
            driver, f"route-to-{name}", topo.PRIMARY_GATEWAY, "Accepted", "True", "Accepted"
        )
        pool_must_have_one_of(driver, name, topo.PRIMARY_GATEWAY, [("ResolvedRefs", "False", "")])
        eventually(driver, primary_address, Request(path), Expected(statuses=SERVER_ERRORS))


@pytest.mark.conformance("InferencePoolMissingEPPRef")
def test_pool_without_picker_reference(driver: Driver) -> None:
    """endpointPickerRef is optional since GIE v1.6: the pool is stored, the route is
    accepted, and the pool's Gateway parent is Accepted, or not with reason
    EndpointPickerRefMissing."""
    with applied(driver, "inferencepool_missing_epp_ref"):
        route_must_have(
            driver,
            "httproute-for-missing-epp-ref-pool",
            topo.PRIMARY_GATEWAY,
            "Accepted",
            "True",
            "Accepted",
        )
        pool_must_have_one_of(
            driver, "pool-with-missing-epp-ref", topo.PRIMARY_GATEWAY,
            [("Accepted", "True", ""), ("Accepted", "False", "EndpointPickerRefMissing")],
        )  # fmt: skip


@pytest.mark.conformance("HTTPRouteInvalidInferencePoolRef")
def test_httproute_to_a_missing_pool(driver: Driver) -> None:
    with applied(driver, "httproute_invalid_inferencepool_ref"):
        route = "httproute-to-non-existent-pool"
        route_must_have(driver, route, topo.PRIMARY_GATEWAY, "Accepted", "True", "Accepted")
        route_must_have(
            driver, route, topo.PRIMARY_GATEWAY, "ResolvedRefs", "False", "BackendNotFound"
        )


@pytest.mark.conformance("InferencePoolHTTPRoutePortValidation")
def test_httproute_backend_port_is_ignored(driver: Driver, primary_address: str) -> None:
    """A backendRef port on an InferencePool is ignored: unspecified, matching and
    non-matching ports all route (plain GETs: any pod of the pool)."""
    with applied(driver, "inferencepool_httproute_port_validation"):
        for variant in ("unspecified", "matching", "non-matching"):
            route_must_be_accepted_and_resolved(
                driver, f"httproute-pool-port-{variant}", topo.PRIMARY_GATEWAY
            )
            pool_must_be_accepted_by(driver, topo.PRIMARY_POOL, topo.PRIMARY_GATEWAY)
            request = Request(f"/test-port-{variant}", f"port-{variant}.example.com")
            eventually(driver, primary_address, request, Expected(backend=topo.PRIMARY_DEPLOYMENT))


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
    """infergate's own: the CRD's validation refuses what GIE's API forbids (422)."""
    with pytest.raises(KubeError) as rejected:
        driver.kube.apply(_pool("pool-with-invalid-ports", targetPorts=ports))
    assert rejected.value.status == 422, f"{why}: {rejected.value}"
    assert driver.kube.get("InferencePool", NS, "pool-with-invalid-ports") is None
