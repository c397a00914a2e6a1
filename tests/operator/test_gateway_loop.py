"""One pass of the Gateway controller's loop without a cluster: kopf's indexes as plain
mappings, the real translator and ADS server, a recording client for the writes."""

from __future__ import annotations

import asyncio
from typing import Any

from infergate.gateway.types import GATEWAY_CONTROLLER_NAME, ROUTE_TYPE
from infergate.operator.gateway.controller import (
    INDEXES,
    GatewayController,
    collect,
    gw_proxy_deployments,
    gw_services,
    reconcile_once,
)
from infergate.operator.gateway.sync import GatewaySync
from infergate.operator.gateway.xds import XdsPublisher, proxy_config_factory
from infergate.operator.settings import GatewaySettings, OperatorSettings

from .test_gateway_objects import RecordingKube

Obj = dict[str, Any]
GW = "gateway.networking.k8s.io"


def _meta(name: str, namespace: str | None = "ns", **extra: Any) -> Obj:
    meta: Obj = {"name": name, "uid": f"uid-{name}", "generation": 1, "resourceVersion": "1"}
    meta["creationTimestamp"] = "2025-01-01T00:00:00Z"
    if namespace:
        meta["namespace"] = namespace
    return {**meta, **extra}


def world() -> dict[str, dict[tuple[str, str], list[Obj]]]:
    """kopf's indexes as the loop reads them: (namespace, name) -> [object]."""
    objects: dict[str, list[Obj]] = {
        "gw_classes": [
            {
                "apiVersion": f"{GW}/v1", "kind": "GatewayClass", "metadata": _meta("infergate", None),
                "spec": {"controllerName": GATEWAY_CONTROLLER_NAME},
            }
        ],
        "gw_gateways": [
            {
                "apiVersion": f"{GW}/v1", "kind": "Gateway", "metadata": _meta("gw"),
                "spec": {
                    "gatewayClassName": "infergate",
                    "listeners": [{"name": "http", "port": 8080, "protocol": "HTTP",
                                   "allowedRoutes": {"namespaces": {"from": "Same"}}}],
                },
            }
        ],
        "gw_http_routes": [
            {
                "apiVersion": f"{GW}/v1", "kind": "HTTPRoute", "metadata": _meta("r"),
                "spec": {
                    "parentRefs": [{"group": GW, "kind": "Gateway", "name": "gw"}],
                    "rules": [{
                        "matches": [{"path": {"type": "PathPrefix", "value": "/echo"}}],
                        "backendRefs": [{"group": "", "kind": "Service", "name": "echo", "port": 80, "weight": 1}],
                    }],
                },
            }
        ],
        "gw_services": [
            {
                "apiVersion": "v1", "kind": "Service", "metadata": _meta("echo"),
                "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.9", "selector": {"app": "echo"},
                         "ports": [{"name": "http", "port": 80, "targetPort": 80, "protocol": "TCP"}]},
            }
        ],
        "gw_namespaces": [{"apiVersion": "v1", "kind": "Namespace", "metadata": _meta("ns", None)}],
    }  # fmt: skip
    out: dict[str, dict[tuple[str, str], list[Obj]]] = {name: {} for name in INDEXES}
    for name, items in objects.items():
        for obj in items:
            meta = obj["metadata"]
            out[name][(meta.get("namespace") or "", meta["name"])] = [obj]
    return out


async def test_one_pass_publishes_the_route_and_writes_what_changed() -> None:
    settings = GatewaySettings(xds_port=0, xds_listen_address="127.0.0.1")
    kube = RecordingKube()
    xds = XdsPublisher(settings)
    await xds.start()
    try:
        factory = proxy_config_factory(settings, xds.port)
        sync = GatewaySync(kube, settings, OperatorSettings(), factory)  # type: ignore[arg-type]
        controller = GatewayController(settings=settings, sync=sync, xds=xds)
        indexes: Any = world()
        await reconcile_once(controller, indexes)
        snapshot = xds.server.snapshot("ns/gw")
        assert snapshot is not None
        (routes,) = snapshot.resources[ROUTE_TYPE]
        text = str(routes)
        assert "/echo" in text and "echo" in text
        writes = [call for call in kube.calls if not call.startswith("get")]
        assert "apply Deployment gw-infergate" in writes
        assert "status GatewayClass infergate" in writes
        assert "status Gateway gw" in writes
        assert "status HTTPRoute r" in writes
        # Not programmed: no proxy connected (and no Deployment available).
        objects = collect(indexes, {}, xds)
        assert objects.gateway_programmed == {("ns", "gw"): False}
        assert objects.gateway_addresses == {("ns", "gw"): ()}
        # The same world again: nothing new to publish (same versions), proxies up to date
        # per the caches, statuses skipped while our write is still on its way.
        kube.calls.clear()
        await reconcile_once(controller, indexes)
        assert [c for c in kube.calls if not c.startswith("get")] == []
        # The watches show the proxy objects as applied (through the real index functions):
        # with the in-flight memory forgotten, they are compared and left alone.
        index_fns: dict[str, Any] = {
            "Deployment": gw_proxy_deployments,
            "Service": gw_services,
        }
        for (kind, namespace, name), obj in kube.live.items():
            index = index_fns.get(kind)
            if index is not None:
                live = {**obj, "metadata": {**obj["metadata"], "resourceVersion": "7"}}
                entry = index(body=live, namespace=namespace, name=name)
                indexes[index.__name__].update({k: [v] for k, v in entry.items()})
        controller.sync.forget()
        kube.calls.clear()
        await reconcile_once(controller, indexes)
        assert [c for c in kube.calls if c.startswith(("apply", "delete"))] == []
    finally:
        await asyncio.wait_for(xds.stop(), 10)


def test_the_readiness_port_never_takes_a_listener_port() -> None:
    """The kubelet probes /ready on a port of its own; a Gateway listening on that port
    moves it (the proxy could not bind both)."""
    settings = GatewaySettings(xds_address="infergate-xds.ns.svc")
    factory = proxy_config_factory(settings, 18000)
    gateway: Obj = {
        "metadata": {"name": "gw", "namespace": "ns"},
        "spec": {"listeners": [{"name": "a", "port": 19001, "protocol": "HTTP"}]},
    }
    proxy = factory(gateway)
    assert proxy.ready_port == 19002
    assert proxy.drain_port == 19003  # the shutdown manager's port moves on past both
    (ready,) = proxy.bootstrap["static_resources"]["listeners"]
    assert ready["address"]["socket_address"]["port_value"] == 19002
    assert proxy.bootstrap["node"]["id"] == "ns/gw"
    xds = proxy.bootstrap["static_resources"]["clusters"][0]["load_assignment"]
    endpoint = xds["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert (endpoint["address"], endpoint["port_value"]) == ("infergate-xds.ns.svc", 18000)
    assert proxy.bootstrap["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    assert any("$(POD_IP)" in arg for arg in proxy.args)
