"""The Gateway API controller against a real API server, with the chart's ServiceAccount.

The chart (with its Gateway API CRDs and GatewayClass ``infergate``) is installed by the
real ``helm``, watching two namespaces; the operator runs from this checkout as a local
process whose only credential is a TokenRequest token for the chart's ServiceAccount.
Each case applies Gateway API objects with ``kubectl`` and reads the statuses the
operator wrote. Bad input must end as a status condition, never as a crash (the
operator is checked alive after every case) and never as a route to the wrong backend
(the Envoy that dials the operator's xDS server is checked where a case routes).

The real Envoy here plays a Gateway pod (kwok runs no containers): it is started from
the ConfigMap and arguments the operator made for the Gateway, with ``$(POD_IP)`` set
to 127.0.0.1 and its admin and readiness ports moved to free ones.
"""

from __future__ import annotations

import functools
import json
import os
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from infergate.gateway.bootstrap import ADMIN_CLUSTER
from infergate.gateway.translate import SHADOWED
from infergate.operator import constants as c
from infergate.operator.gateway.objects import ENVOY_CONTAINER, proxy_name
from infergate.procs import ManagedProcess, ProcessGroup, free_port, http_ready
from tests.support.controlplane import Cluster

from .test_cluster import wait_for

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
GROUP = "gateway.networking.k8s.io"
CONTROLLER = "infergate.io/gateway-controller"
CLASS = "infergate"
Obj = dict[str, Any]
CRDS = [
    f"{plural}.{GROUP}"
    for plural in ("gatewayclasses", "gateways", "httproutes", "referencegrants")
]
CRDS.append(f"inferencepools.{c.POOL_GROUP}")


@dataclass
class GatewayEnv:
    cluster: Cluster
    ns: str  # Gateways, routes and pools
    other: str  # the cross-namespace backends
    operator: ManagedProcess
    xds_port: int
    processes: ProcessGroup

    def apply(self, *objs: Obj, namespace: str | None = None) -> None:
        stdin = "\n---\n".join(json.dumps(o) for o in objs)
        self.cluster.kubectl("apply", "-n", namespace or self.ns, "-f", "-", stdin=stdin)

    def get(self, kind: str, name: str, namespace: str | None = None) -> Obj:
        return self.cluster.get(kind, name, namespace or self.ns) or {}


@pytest.fixture(scope="module")
def gw(cluster: Cluster, infergate_cli: list[str]) -> Iterator[GatewayEnv]:
    """The chart in two fresh namespaces and one operator for the whole module."""
    suffix = uuid.uuid4().hex[:6]
    ns, other = f"ig-gw-{suffix}", f"ig-gwb-{suffix}"
    for name in (ns, other):
        cluster.kubectl("create", "namespace", name)
    cluster.helm(
        "install", "ig", str(ROOT / "charts" / "infergate"), "-n", ns,
        "--set", f"operator.watchNamespaces={{{ns},{other}}}",
        "--set", "gateway.serviceType=ClusterIP",
    )  # fmt: skip
    # kopf reads the served resources once at start: the CRDs Helm just created must be
    # served by then (an operator pod starts long after them; a local process does not).
    for crd in CRDS:
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
    processes = ProcessGroup()
    try:
        kubeconfig = cluster.service_account_kubeconfig(ns, "ig-infergate")
        xds_port, health = free_port(), free_port()
        env = dict(
            os.environ,
            KUBECONFIG=str(kubeconfig),
            INFERGATE_RESYNC_SECONDS="2",
            INFERGATE_EPP_IMAGE="registry.example/infergate-epp:test",
            INFERGATE_ENVOY_IMAGE="registry.example/envoy:test",
        )
        operator = processes.start(
            "operator",
            [*infergate_cli, "operator", f"--namespace={ns}", f"--namespace={other}",
             "--standalone", f"--liveness=http://127.0.0.1:{health}/healthz",
             f"--xds-port={xds_port}", "--xds-listen-address=127.0.0.1",
             "--xds-address=127.0.0.1", "--gateway-service-type=ClusterIP"],
            ready=http_ready(f"http://127.0.0.1:{health}/healthz"), timeout=120, env=env,
        )  # fmt: skip
        yield GatewayEnv(cluster, ns, other, operator, xds_port, processes)
    finally:
        processes.stop_all()
        cluster.helm("uninstall", "ig", "-n", ns, check=False)
        for name in (ns, other):
            cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(autouse=True)
def operator_survives(gw: GatewayEnv) -> Iterator[None]:
    """Whatever a case feeds it, the operator is still running afterwards."""
    yield
    assert gw.operator.alive(), f"the operator exited:\n{gw.operator.log_tail()}"
    assert "Traceback" not in gw.operator.log_tail(200_000), gw.operator.log_tail()


# -- objects -----------------------------------------------------------------------------------


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:5]}"


def gateway(name: str, listeners: list[Obj] | None = None) -> Obj:
    return {
        "apiVersion": f"{GROUP}/v1",
        "kind": "Gateway",
        "metadata": {"name": name},
        "spec": {
            "gatewayClassName": CLASS,
            "listeners": listeners
            or [
                {
                    "name": "http",
                    "port": free_port(),
                    "protocol": "HTTP",
                    "allowedRoutes": {"namespaces": {"from": "Same"}},
                }
            ],
        },
    }


def route(name: str, gateway_name: str, backend: Obj, path: str = "/", hostname: str = "") -> Obj:
    spec: Obj = {
        "parentRefs": [{"name": gateway_name}],
        "rules": [
            {"matches": [{"path": {"type": "PathPrefix", "value": path}}], "backendRefs": [backend]}
        ],
    }
    if hostname:
        spec["hostnames"] = [hostname]
    return {
        "apiVersion": f"{GROUP}/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": name},
        "spec": spec,
    }


def pool_ref(name: str) -> Obj:
    return {"group": c.POOL_GROUP, "kind": "InferencePool", "name": name}


def service_ref(name: str, port: int, namespace: str | None = None) -> Obj:
    ref: Obj = {"kind": "Service", "name": name, "port": port}
    if namespace:
        ref["namespace"] = namespace
    return ref


def service(name: str, port: int) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {
            "selector": {"app": name},
            "ports": [{"name": "http", "port": port, "targetPort": port}],
        },
    }


def pool(name: str, picker: str, picker_port: int = 9002) -> Obj:
    body: Obj = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())
    body["metadata"] = {"name": name}
    body["spec"]["selector"] = {"matchLabels": {"app": name}}
    body["spec"]["endpointPickerRef"] = {"name": picker, "port": {"number": picker_port}}
    return body


# -- reading statuses --------------------------------------------------------------------------


def conditions(entries: Any) -> dict[str, str]:
    return {x["type"]: f"{x['status']}/{x['reason']}" for x in entries or []}


def route_parent(gw: GatewayEnv, name: str, gateway_name: str) -> dict[str, str]:
    """Our controller's conditions on the route for one Gateway."""
    body = gw.get("httproute", name)
    for parent in (body.get("status") or {}).get("parents") or []:
        if (
            parent.get("controllerName") == CONTROLLER
            and parent["parentRef"]["name"] == gateway_name
        ):
            return conditions(parent.get("conditions"))
    return {}


def pool_parent(gw: GatewayEnv, name: str, gateway_name: str) -> dict[str, str]:
    body = gw.get("inferencepool", name)
    for parent in (body.get("status") or {}).get("parents") or []:
        ref = parent.get("parentRef") or {}
        if ref.get("kind") == "Gateway" and ref.get("name") == gateway_name:
            return conditions(parent.get("conditions"))
    return {}


def gateway_conditions(gw: GatewayEnv, name: str) -> dict[str, str]:
    return conditions((gw.get("gateway", name).get("status") or {}).get("conditions"))


def listener_conditions(gw: GatewayEnv, name: str, listener: str) -> dict[str, str]:
    for entry in (gw.get("gateway", name).get("status") or {}).get("listeners") or []:
        if entry["name"] == listener:
            return conditions(entry.get("conditions"))
    return {}


def has(probe: Callable[[], dict[str, str]], **want: str) -> Callable[[], bool]:
    """A wait_for probe: every ``type=status/reason`` (or ``type=status``) holds."""

    def check() -> bool:
        got = probe()
        return all(got.get(t, "").startswith(v) for t, v in want.items())

    return check


def accepted_gateway(gw: GatewayEnv, name: str, **listener: Any) -> Obj:
    body = gateway(name, [listener] if listener else None)
    gw.apply(body)
    wait_for(has(lambda: gateway_conditions(gw, name), Accepted="True"), f"Gateway {name} Accepted")
    return body


# -- an Envoy in the Gateway's place -----------------------------------------------------------


def run_proxy(gw: GatewayEnv, name: str, envoy_binary: Path) -> tuple[ManagedProcess, int]:
    """The real Envoy, started as the Gateway's pod would be; returns it and its admin port."""
    proxy = proxy_name(name)
    config_map = wait_for(lambda: gw.get("configmap", proxy), f"ConfigMap {proxy}")
    deployment = wait_for(lambda: gw.get("deployment", proxy), f"Deployment {proxy}")
    bootstrap = yaml.safe_load(config_map["data"][c.ENVOY_CONFIG_KEY])
    admin, ready = free_port(), free_port()
    bootstrap["admin"] = {
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}
    }
    for listener in bootstrap["static_resources"].get("listeners") or []:
        listener["address"]["socket_address"].update(address="127.0.0.1", port_value=ready)
    for cluster in bootstrap["static_resources"]["clusters"]:
        if cluster["name"] == ADMIN_CLUSTER:  # /ready is proxied to the admin API
            (host,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
            host["endpoint"]["address"]["socket_address"]["port_value"] = admin
    path = gw.cluster.workdir / f"{proxy}-{uuid.uuid4().hex[:4]}.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    containers = deployment["spec"]["template"]["spec"]["containers"]
    (container,) = [k for k in containers if k["name"] == ENVOY_CONTAINER]  # beside its drainer
    args = [re.sub(r"\$\(POD_IP\)", "127.0.0.1", a) for a in container["args"]]
    args[args.index("--config-path") + 1] = str(path)
    process = gw.processes.start(
        f"envoy-{name}", [str(envoy_binary), *args, "--concurrency", "1"],
        ready=http_ready(f"http://127.0.0.1:{ready}/ready"), timeout=60,
    )  # fmt: skip
    return process, admin


def route_dump(admin: int) -> list[Obj]:
    """The route configurations the Envoy serves (its admin config_dump)."""
    import urllib.request

    with urllib.request.urlopen(
        f"http://127.0.0.1:{admin}/config_dump?resource=dynamic_route_configs", timeout=5
    ) as r:
        dump = json.loads(r.read())
    return [entry["route_config"] for entry in dump.get("configs") or []]


def _clusters(entry: Obj) -> set[str]:
    action = entry.get("route") or {}
    names = {action["cluster"]} if "cluster" in action else set()
    return names | {
        w["name"] for w in (action.get("weighted_clusters") or {}).get("clusters") or []
    }


def routed_clusters(admin: int, path: str, host: str = "") -> set[str]:
    """Where Envoy sends a request for ``path`` (on ``host``): the clusters of the first
    route whose prefix or path is ``path``, in the first virtual host serving ``host``
    (Envoy's first-match semantics), or of every such route when ``host`` is empty."""
    out: set[str] = set()
    for config in route_dump(admin):
        for vhost in config.get("virtual_hosts") or []:
            if (
                host
                and host not in vhost.get("domains", [])
                and "*" not in vhost.get("domains", [])
            ):
                continue
            for entry in vhost.get("routes") or []:
                match = entry.get("match") or {}
                if path in (
                    match.get("prefix"),
                    match.get("path"),
                    match.get("path_separated_prefix"),
                ):
                    if host:
                        return _clusters(entry)
                    out |= _clusters(entry)
    return out


# -- cases -------------------------------------------------------------------------------------


def test_the_chart_gateway_class_is_accepted(gw: GatewayEnv) -> None:
    wait_for(
        lambda: conditions((gw.cluster.get("gatewayclass", CLASS) or {}).get("status", {}).get("conditions")).get("Accepted")
        == "True/Accepted",
        "GatewayClass infergate Accepted",
    )  # fmt: skip


def test_a_gateway_gets_its_proxy_and_loses_it_when_deleted(
    gw: GatewayEnv, envoy_binary: Path
) -> None:
    name = unique("gw")
    body = accepted_gateway(gw, name)
    proxy = proxy_name(name)
    uid = gw.get("gateway", name)["metadata"]["uid"]
    for kind in ("configmap", "deployment", "service"):
        obj = wait_for(functools.partial(gw.get, kind, proxy), f"the Gateway's {kind}")
        (owner,) = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("Gateway", name, uid)
    service_ports = [p["port"] for p in gw.get("service", proxy)["spec"]["ports"]]
    assert service_ports == [body["spec"]["listeners"][0]["port"]]
    # Addresses: the Service's cluster IP (ClusterIP Services here).
    cluster_ip = gw.get("service", proxy)["spec"]["clusterIP"]
    wait_for(
        lambda: [a["value"] for a in gw.get("gateway", name).get("status", {}).get("addresses") or []] == [cluster_ip],
        "the Gateway's address",
    )  # fmt: skip
    # Not Programmed until an Envoy of it acked its config (kwok makes the pod Ready).
    wait_for(lambda: gw.get("deployment", proxy).get("status", {}).get("availableReplicas"), "pod")
    assert not gateway_conditions(gw, name).get("Programmed", "").startswith("True")
    run_proxy(gw, name, envoy_binary)
    wait_for(has(lambda: gateway_conditions(gw, name), Programmed="True"), "Programmed once acked")

    gw.cluster.kubectl("delete", "gateway", name, "-n", gw.ns)
    for kind in ("configmap", "deployment", "service"):
        wait_for(lambda kind=kind: not gw.get(kind, proxy), f"garbage collection of the {kind}")  # type: ignore[misc]


def test_the_snapshot_routes_a_path_to_its_backend_and_follows_changes(
    gw: GatewayEnv, envoy_binary: Path
) -> None:
    name, backend, other_backend = unique("gw"), unique("echo"), unique("echo")
    accepted_gateway(gw, name)
    gw.apply(service(backend, 8080), service(other_backend, 8081))
    _, admin = run_proxy(gw, name, envoy_binary)
    first = route(unique("r"), name, service_ref(backend, 8080), path="/one")
    gw.apply(first)
    wait_for(has(lambda: route_parent(gw, first["metadata"]["name"], name), Accepted="True", ResolvedRefs="True"), "route resolved")  # fmt: skip
    clusters = wait_for(lambda: routed_clusters(admin, "/one"), "the route in Envoy's config")
    assert len(clusters) == 1 and backend in next(iter(clusters))
    # A change reaches the running Envoy without a restart.
    first["spec"]["rules"][0]["backendRefs"] = [service_ref(other_backend, 8081)]
    gw.apply(first)
    wait_for(
        lambda: any(other_backend in x for x in routed_clusters(admin, "/one")), "the new backend"
    )
    assert not any(backend in x and other_backend not in x for x in routed_clusters(admin, "/one"))


def test_a_route_to_a_missing_pool_is_backend_not_found(gw: GatewayEnv) -> None:
    name = unique("gw")
    accepted_gateway(gw, name)
    body = route(unique("r"), name, pool_ref("no-such-pool"))
    gw.apply(body)
    wait_for(
        has(lambda: route_parent(gw, body["metadata"]["name"], name), ResolvedRefs="False/BackendNotFound"),
        "ResolvedRefs=False BackendNotFound",
    )  # fmt: skip


def test_a_route_to_an_unsupported_kind_is_invalid_kind(gw: GatewayEnv) -> None:
    name = unique("gw")
    accepted_gateway(gw, name)
    body = route(unique("r"), name, {"group": "example.com", "kind": "Widget", "name": "w"})
    gw.apply(body)
    wait_for(
        has(lambda: route_parent(gw, body["metadata"]["name"], name), ResolvedRefs="False/InvalidKind"),
        "ResolvedRefs=False InvalidKind",
    )  # fmt: skip


def test_a_cross_namespace_service_needs_a_reference_grant(gw: GatewayEnv) -> None:
    name, backend = unique("gw"), unique("echo")
    accepted_gateway(gw, name)
    gw.apply(service(backend, 8080), namespace=gw.other)
    body = route(unique("r"), name, service_ref(backend, 8080, namespace=gw.other))
    gw.apply(body)
    parent = functools.partial(route_parent, gw, body["metadata"]["name"], name)
    wait_for(has(parent, ResolvedRefs="False/RefNotPermitted"), "RefNotPermitted")
    grant: Obj = {
        "apiVersion": f"{GROUP}/v1beta1",
        "kind": "ReferenceGrant",
        "metadata": {"name": unique("grant")},
        "spec": {
            "from": [{"group": GROUP, "kind": "HTTPRoute", "namespace": gw.ns}],
            "to": [{"group": "", "kind": "Service", "name": backend}],
        },
    }
    gw.apply(grant, namespace=gw.other)
    wait_for(has(parent, ResolvedRefs="True"), "resolved once the grant exists")
    gw.cluster.kubectl("delete", "referencegrant", grant["metadata"]["name"], "-n", gw.other)
    wait_for(has(parent, ResolvedRefs="False/RefNotPermitted"), "RefNotPermitted again")


def test_an_unsupported_listener_protocol_is_a_listener_condition(gw: GatewayEnv) -> None:
    name = unique("gw")
    body = gateway(
        name,
        [
            {"name": "http", "port": free_port(), "protocol": "HTTP"},
            {"name": "udp", "port": free_port(), "protocol": "UDP"},
        ],
    )
    gw.apply(body)
    wait_for(
        has(lambda: listener_conditions(gw, name, "udp"), Accepted="False/UnsupportedProtocol"),
        "listener udp Accepted=False UnsupportedProtocol",
    )  # fmt: skip
    assert listener_conditions(gw, name, "http").get("Accepted", "").startswith("True")


def test_conflicting_routes_the_oldest_keeps_the_path(gw: GatewayEnv, envoy_binary: Path) -> None:
    """Two routes claim the same host and path: Gateway API's precedence (the older route
    first) decides, so traffic never moves to the newcomer's backend. Both are Accepted,
    as the spec (and its conformance suite) wants for overlapping routes."""
    name, old_backend, new_backend = unique("gw"), unique("old"), unique("new")
    accepted_gateway(gw, name)
    gw.apply(service(old_backend, 8080), service(new_backend, 8080))
    _, admin = run_proxy(gw, name, envoy_binary)
    # creationTimestamp has one-second resolution: two routes made within a second tie,
    # and the spec breaks the tie by namespace/name, so the older also sorts first.
    older = route(
        unique("a-r"), name, service_ref(old_backend, 8080), path="/same", hostname="a.example"
    )
    gw.apply(older)
    wait_for(has(lambda: route_parent(gw, older["metadata"]["name"], name), Accepted="True", ResolvedRefs="True"), "older route")  # fmt: skip
    wait_for(lambda: routed_clusters(admin, "/same", "a.example"), "the route in Envoy's config")
    newer = route(
        unique("b-r"), name, service_ref(new_backend, 8080), path="/same", hostname="a.example"
    )
    gw.apply(newer)
    newer_parent = functools.partial(route_parent, gw, newer["metadata"]["name"], name)
    wait_for(has(newer_parent, Accepted="True", ResolvedRefs="True"), "the newer route's status")
    wait_for(lambda: len(routed_clusters(admin, "/same")) == 2, "both routes in Envoy's config")
    (winner,) = routed_clusters(admin, "/same", "a.example")
    assert old_backend in winner and new_backend not in winner, winner
    # The newcomer's owner is told, on its parent entry, which route serves its match.
    wait_for(has(newer_parent, **{SHADOWED: "True"}), "the newer route's Shadowed condition")
    assert SHADOWED not in route_parent(gw, older["metadata"]["name"], name)


def test_a_pool_whose_epp_service_lacks_the_port_is_not_resolved(gw: GatewayEnv) -> None:
    name, pool_name, picker = unique("gw"), unique("pool"), unique("picker")
    accepted_gateway(gw, name)
    gw.apply(service(picker, 1234), pool(pool_name, picker, picker_port=9002))
    body = route(unique("r"), name, pool_ref(pool_name))
    gw.apply(body)
    wait_for(
        has(lambda: pool_parent(gw, pool_name, name), ResolvedRefs="False"),
        "the pool's parent entry for the Gateway: ResolvedRefs=False",
    )  # fmt: skip
    # The operator's own standalone entry stays beside the Gateway's.
    parents = gw.get("inferencepool", pool_name)["status"]["parents"]
    assert {p.get("controllerName") for p in parents} >= {CONTROLLER, c.CONTROLLER_NAME}
