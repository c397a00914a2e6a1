"""Builders for the Kubernetes JSON bodies the translator reads (as the API server
returns them, CRD defaults applied), and a realistic world shaped like GIE's
conformance setup. Imported by the tests of this folder (conftest puts it on sys.path)."""

from __future__ import annotations

from typing import Any

from infergate.gateway.types import GATEWAY_CONTROLLER_NAME, GATEWAY_GROUP, ClusterObjects

Obj = dict[str, Any]
POOL_GROUP = "inference.networking.k8s.io"
CLASS = "infergate"
INFRA = "infra"
APPS = "apps"


def _meta(name: str, namespace: str | None = None, **extra: Any) -> Obj:
    out: Obj = {"name": name, "generation": extra.pop("generation", 1)}
    if namespace is not None:
        out["namespace"] = namespace
    out["creationTimestamp"] = extra.pop("created", "2025-01-01T00:00:00Z")
    out.update(extra)
    return out


def gateway_class(name: str = CLASS, controller: str = GATEWAY_CONTROLLER_NAME, **spec: Any) -> Obj:
    return {
        "apiVersion": f"{GATEWAY_GROUP}/v1",
        "kind": "GatewayClass",
        "metadata": _meta(name),
        "spec": {"controllerName": controller, **spec},
    }


def listener(
    name: str = "http",
    port: int = 80,
    protocol: str = "HTTP",
    hostname: str | None = None,
    from_: str = "Same",
    selector: Obj | None = None,
    kinds: list[Obj] | None = None,
) -> Obj:
    out: Obj = {"name": name, "port": port, "protocol": protocol}
    if hostname is not None:
        out["hostname"] = hostname
    namespaces: Obj = {"from": from_}
    if selector is not None:
        namespaces["selector"] = selector
    out["allowedRoutes"] = {"namespaces": namespaces}
    if kinds is not None:
        out["allowedRoutes"]["kinds"] = kinds
    return out


def gateway(
    name: str = "gw",
    namespace: str = INFRA,
    listeners: list[Obj] | None = None,
    class_name: str = CLASS,
    generation: int = 1,
    **spec: Any,
) -> Obj:
    return {
        "apiVersion": f"{GATEWAY_GROUP}/v1",
        "kind": "Gateway",
        "metadata": _meta(name, namespace, generation=generation),
        "spec": {
            "gatewayClassName": class_name,
            "listeners": listeners if listeners is not None else [listener(from_="All")],
            **spec,
        },
    }


def parent(
    name: str = "gw",
    namespace: str | None = INFRA,
    section: str | None = None,
    port: int | None = None,
) -> Obj:
    out: Obj = {"group": GATEWAY_GROUP, "kind": "Gateway", "name": name}
    if namespace is not None:
        out["namespace"] = namespace
    if section is not None:
        out["sectionName"] = section
    if port is not None:
        out["port"] = port
    return out


def pool_ref(
    name: str, namespace: str | None = None, port: int | None = None, weight: int = 1
) -> Obj:
    out: Obj = {"group": POOL_GROUP, "kind": "InferencePool", "name": name, "weight": weight}
    if namespace is not None:
        out["namespace"] = namespace
    if port is not None:
        out["port"] = port
    return out


def service_ref(
    name: str, port: int | None = 8080, namespace: str | None = None, weight: int = 1, **extra: Any
) -> Obj:
    out: Obj = {"group": "", "kind": "Service", "name": name, "weight": weight, **extra}
    if namespace is not None:
        out["namespace"] = namespace
    if port is not None:
        out["port"] = port
    return out


def path(value: str = "/", kind: str = "PathPrefix") -> Obj:
    return {"path": {"type": kind, "value": value}}


def rule(
    backends: list[Obj] | None = None,
    matches: list[Obj] | None = None,
    filters: list[Obj] | None = None,
    **extra: Any,
) -> Obj:
    out: Obj = {"matches": matches if matches is not None else [path("/")]}
    if backends is not None:
        out["backendRefs"] = backends
    if filters is not None:
        out["filters"] = filters
    out.update(extra)
    return out


def http_route(
    name: str,
    namespace: str = APPS,
    parents: list[Obj] | None = None,
    rules: list[Obj] | None = None,
    hostnames: list[str] | None = None,
    created: str = "2025-01-01T00:00:00Z",
    generation: int = 1,
) -> Obj:
    spec: Obj = {"parentRefs": parents if parents is not None else [parent()]}
    if hostnames:
        spec["hostnames"] = hostnames
    spec["rules"] = rules if rules is not None else [rule()]
    return {
        "apiVersion": f"{GATEWAY_GROUP}/v1",
        "kind": "HTTPRoute",
        "metadata": _meta(name, namespace, created=created, generation=generation),
        "spec": spec,
    }


def pool(
    name: str,
    namespace: str = APPS,
    labels: dict[str, str] | None = None,
    ports: tuple[int, ...] = (3000,),
    epp: tuple[str, int] | None = None,
    failure_mode: str | None = None,
    app_protocol: str | None = None,
    generation: int = 1,
) -> Obj:
    spec: Obj = {
        "selector": {"matchLabels": labels or {"app": name}},
        "targetPorts": [{"number": p} for p in ports],
    }
    if epp is not None:
        spec["endpointPickerRef"] = {
            "group": "",
            "kind": "Service",
            "name": epp[0],
            "port": {"number": epp[1]},
            "failureMode": failure_mode or "FailClose",
        }
    if app_protocol is not None:
        spec["appProtocol"] = app_protocol
    return {
        "apiVersion": f"{POOL_GROUP}/v1",
        "kind": "InferencePool",
        "metadata": _meta(name, namespace, generation=generation),
        "spec": spec,
    }


def service(
    name: str,
    namespace: str = APPS,
    selector: dict[str, str] | None = None,
    ports: list[Obj] | None = None,
    **spec: Any,
) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, namespace),
        "spec": {
            "selector": selector if selector is not None else {"app": name},
            "ports": ports if ports is not None else [{"port": 8080, "targetPort": 8080}],
            **spec,
        },
    }


def pod(
    name: str,
    ip: str,
    labels: dict[str, str],
    namespace: str = APPS,
    ready: bool = True,
    ports: dict[str, int] | None = None,
) -> Obj:
    containers = [
        {
            "name": "main",
            "ports": [
                {"name": n, "containerPort": p, "protocol": "TCP"} for n, p in (ports or {}).items()
            ],
        }
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _meta(name, namespace, labels=labels),
        "spec": {"containers": containers},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def namespace(name: str, labels: dict[str, str] | None = None) -> Obj:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": _meta(name, labels=labels or {})}


def reference_grant(
    namespace: str,
    from_namespace: str,
    to_kind: str,
    to_group: str = "",
    to_name: str | None = None,
) -> Obj:
    to: Obj = {"group": to_group, "kind": to_kind}
    if to_name is not None:
        to["name"] = to_name
    return {
        "apiVersion": f"{GATEWAY_GROUP}/v1beta1",
        "kind": "ReferenceGrant",
        "metadata": _meta(f"grant-{from_namespace}", namespace),
        "spec": {
            "from": [{"group": GATEWAY_GROUP, "kind": "HTTPRoute", "namespace": from_namespace}],
            "to": [to],
        },
    }


def world(**overrides: Any) -> ClusterObjects:
    """GIE's conformance shape: one Gateway (port 80, routes from All namespaces), two
    pools of 3 model servers with their EPPs (secondary FailOpen), an HTTPRoute per pool
    and a plain Service route; everything Ready."""
    objects: dict[str, Any] = {
        "gateway_classes": (gateway_class(),),
        "gateways": (gateway(),),
        "http_routes": (
            http_route(
                "primary",
                hostnames=["primary.example.com"],
                rules=[rule([pool_ref("primary", port=3000)], [path("/primary")])],
            ),
            http_route(
                "secondary",
                rules=[rule([pool_ref("secondary")], [path("/secondary")])],
            ),
            http_route("echo", rules=[rule([service_ref("echo")], [path("/echo")])]),
        ),
        "inference_pools": (
            pool("primary", epp=("primary-epp", 9002)),
            pool("secondary", epp=("secondary-epp", 9002), failure_mode="FailOpen"),
        ),
        "services": (
            service(
                "primary-epp", ports=[{"port": 9002, "targetPort": 9002, "appProtocol": "http2"}]
            ),
            service("secondary-epp", ports=[{"port": 9002, "targetPort": "grpc"}]),
            service("echo", ports=[{"name": "http", "port": 8080, "targetPort": "web"}]),
        ),
        "pods": (
            *(pod(f"primary-{i}", f"10.0.1.{i + 1}", {"app": "primary"}) for i in range(3)),
            *(pod(f"secondary-{i}", f"10.0.2.{i + 1}", {"app": "secondary"}) for i in range(3)),
            pod("primary-epp-0", "10.0.3.1", {"app": "primary-epp"}),
            pod("secondary-epp-0", "10.0.3.2", {"app": "secondary-epp"}, ports={"grpc": 9002}),
            pod("echo-0", "10.0.4.1", {"app": "echo"}, ports={"web": 3000}),
        ),
        "namespaces": (namespace(INFRA), namespace(APPS)),
        "gateway_addresses": {(INFRA, "gw"): ("10.96.0.10",)},
        "gateway_programmed": {(INFRA, "gw"): True},
    }
    objects.update(overrides)
    return ClusterObjects(**objects)


# --- reading a Translation -------------------------------------------------------------


def conditions(entry: Obj) -> dict[str, tuple[str, str]]:
    """type → (status, reason) of a status entry's conditions."""
    return {c["type"]: (c["status"], c["reason"]) for c in entry["conditions"]}


def snapshot_resources(snapshot: Any, type_url: str) -> dict[str, Obj]:
    """A snapshot's resources of one type by name."""
    return {r.get("name") or r["cluster_name"]: r for r in snapshot.resources[type_url]}


def virtual_hosts(snapshot: Any, port: int = 80) -> dict[str, list[Obj]]:
    """domain → routes, for one port's route table."""
    from infergate.gateway.types import ROUTE_TYPE

    table = snapshot_resources(snapshot, ROUTE_TYPE)[f"http-{port}"]
    return {d: v["routes"] for v in table["virtual_hosts"] for d in v["domains"]}


def route_names(routes: list[Obj]) -> list[str]:
    return [r["name"] for r in routes]
