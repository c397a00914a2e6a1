"""Unit tests of the Gateway controller's pure parts: the per-Gateway proxy objects, the
status merges, and one sync pass against a recording client (no cluster)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from infergate.gateway.types import GATEWAY_CONTROLLER_NAME, ClusterObjects, Snapshot, Translation
from infergate.operator import constants as c
from infergate.operator.gateway import status as gs
from infergate.operator.gateway.objects import (
    LABEL_GATEWAY,
    ProxyConfig,
    build_deployment,
    build_service,
    deployment_available,
    desired_objects,
    gateway_addresses,
    listener_ports,
    proxy_name,
    service_type,
)
from infergate.operator.gateway.sync import GatewaySync
from infergate.operator.kube import KubeError
from infergate.operator.settings import GatewaySettings, OperatorSettings

Obj = dict[str, Any]
PROXY = ProxyConfig(bootstrap={"node": {"id": "ns/gw"}}, args=("--log-level", "info"))


def gateway(
    name: str = "gw", ports: tuple[tuple[int, str], ...] = ((80, "HTTP"),), **meta: Any
) -> Obj:
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "generation": 1,
            **meta,
        },
        "spec": {
            "gatewayClassName": "infergate",
            "listeners": [
                {"name": f"l{i}", "port": port, "protocol": proto}
                for i, (port, proto) in enumerate(ports)
            ],
        },
    }


# -- builders --------------------------------------------------------------------------------


def test_proxy_names_are_dns_labels_and_distinct() -> None:
    assert proxy_name("gw") == "gw-infergate"
    long_a, long_b = "a" * 60 + "x", "a" * 60 + "y"
    for name in (long_a, long_b, "9lives", "my.gateway", "a" * 253):
        out = proxy_name(name)
        assert len(out) <= 63 and out[0].isalpha() and out.replace("-", "").isalnum(), out
    assert proxy_name(long_a) != proxy_name(long_b)
    assert proxy_name("my.gateway") != proxy_name("my-gateway")


def test_service_and_container_ports_follow_the_listeners() -> None:
    gw = gateway(ports=((80, "HTTP"), (80, "HTTP"), (8080, "HTTP"), (443, "HTTPS")))
    assert [(p.name, p.port) for p in listener_ports(gw)] == [
        ("http-80", 80), ("https-443", 443), ("http-8080", 8080),
    ]  # fmt: skip
    service = build_service(gw, "ClusterIP")
    assert [p["port"] for p in service["spec"]["ports"]] == [80, 443, 8080]
    assert all(p["targetPort"] == p["port"] for p in service["spec"]["ports"])
    deployment = build_deployment(gw, PROXY, OperatorSettings(), "hash")
    container, drain = deployment["spec"]["template"]["spec"]["containers"]
    assert {p["containerPort"] for p in container["ports"]} == {80, 443, 8080, PROXY.ready_port}
    assert [p["containerPort"] for p in drain["ports"]] == [PROXY.drain_port]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_envoy_is_drained_before_the_kubelet_stops_it() -> None:
    """Envoy's preStop hook asks the pod's shutdown manager (the EPP image's ``infergate
    envoy-drain``, on Envoy's loopback admin) and returns once Envoy is drained; the pod's
    grace period outlasts the drain timeout, so the kubelet kills nothing still draining."""
    settings = OperatorSettings(epp_image="registry.example/epp:1", drain_seconds=120)
    pod = build_deployment(gateway(), PROXY, settings, "h")["spec"]["template"]["spec"]
    envoy, drain = pod["containers"]
    hook = envoy["lifecycle"]["preStop"]["httpGet"]
    assert (hook["path"], hook["port"]) == ("/shutdown", PROXY.drain_port)
    assert drain["image"] == "registry.example/epp:1"
    assert drain["args"][0] == "envoy-drain"
    args = dict(zip(drain["args"][1::2], drain["args"][2::2], strict=True))
    assert args["--admin-url"] == f"http://127.0.0.1:{PROXY.admin_port}"
    assert args["--port"] == str(PROXY.drain_port)
    assert float(args["--drain-timeout-s"]) == 120
    assert pod["terminationGracePeriodSeconds"] > 120
    assert drain["securityContext"]["readOnlyRootFilesystem"] is True


def test_low_ports_get_net_bind_service_and_the_unprivileged_port_sysctl() -> None:
    low = build_deployment(gateway(ports=((80, "HTTP"),)), PROXY, OperatorSettings(), "h")
    high = build_deployment(gateway(ports=((8080, "HTTP"),)), PROXY, OperatorSettings(), "h")
    for deployment, wants in ((low, True), (high, False)):
        pod = deployment["spec"]["template"]["spec"]
        security = pod["containers"][0]["securityContext"]
        assert security["capabilities"]["drop"] == ["ALL"]
        assert security["runAsNonRoot"] and security["readOnlyRootFilesystem"]
        assert not security["allowPrivilegeEscalation"]
        assert ("add" in security["capabilities"]) is wants
        assert ("sysctls" in pod["securityContext"]) is wants
    pod = low["spec"]["template"]["spec"]
    assert pod["securityContext"]["sysctls"] == [
        {"name": "net.ipv4.ip_unprivileged_port_start", "value": "0"}
    ]
    assert pod["automountServiceAccountToken"] is False


def test_deployment_runs_envoy_from_the_bootstrap_with_pod_ip_and_readiness() -> None:
    settings = OperatorSettings(envoy_image="registry.example/envoy:1")
    objs = desired_objects(gateway(), PROXY, settings, "LoadBalancer")
    config_map, deployment, service = objs
    assert [o["kind"] for o in objs] == ["ConfigMap", "Deployment", "Service"]
    assert "node:" in config_map["data"][c.ENVOY_CONFIG_KEY]
    container, _drain = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example/envoy:1"
    assert container["args"][:2] == ["--config-path", f"{c.ENVOY_CONFIG_DIR}/{c.ENVOY_CONFIG_KEY}"]
    assert container["args"][2:] == list(PROXY.args)
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env["POD_IP"] == "status.podIP"
    probe = container["readinessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/ready", PROXY.ready_port)
    assert "livenessProbe" not in container
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": "envoy-config", "configMap": {"name": "gw-infergate"}} in volumes
    assert service["spec"]["type"] == "LoadBalancer"
    for obj in objs:
        (owner,) = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == ("Gateway", "uid-gw", True)
        assert obj["metadata"]["labels"][LABEL_GATEWAY] == "gw-infergate"
        assert obj["metadata"]["labels"]["gateway.networking.k8s.io/gateway-name"] == "gw"
        assert c.ANNOTATION_SPEC_HASH in obj["metadata"]["annotations"]
    # A new bootstrap rolls the pods; the same one does not.
    other = ProxyConfig(bootstrap={"node": {"id": "other"}})
    again = desired_objects(gateway(), PROXY, settings, "LoadBalancer")[1]
    rolled = desired_objects(gateway(), other, settings, "LoadBalancer")[1]

    def config_hash(d: Obj) -> str:
        return str(d["spec"]["template"]["metadata"]["annotations"][c.ANNOTATION_CONFIG_HASH])

    assert config_hash(again) == config_hash(deployment) != config_hash(rolled)


def test_service_type_annotation_and_infrastructure_metadata() -> None:
    gw = gateway(annotations={"infergate.io/service-type": "ClusterIP"})
    gw["spec"]["infrastructure"] = {"labels": {"team": "a"}, "annotations": {"note": "x"}}
    assert service_type(gw, "LoadBalancer") == "ClusterIP"
    assert (
        service_type(gateway(annotations={"infergate.io/service-type": "Bogus"}), "NodePort")
        == "NodePort"
    )
    for obj in desired_objects(gw, PROXY, OperatorSettings(), "LoadBalancer"):
        assert obj["metadata"]["labels"]["team"] == "a"
        assert obj["metadata"]["annotations"]["note"] == "x"


def test_addresses_and_availability_read_from_the_live_objects() -> None:
    assert gateway_addresses(None) == ()
    service: Obj = {"spec": {"clusterIP": "10.96.0.7", "clusterIPs": ["10.96.0.7"]}}
    assert gateway_addresses(service) == ("10.96.0.7",)
    service["status"] = {
        "loadBalancer": {"ingress": [{"ip": "203.0.113.9"}, {"hostname": "lb.example"}]}
    }
    assert gateway_addresses(service) == ("203.0.113.9", "lb.example")
    assert gateway_addresses({"spec": {"clusterIP": "None"}}) == ()
    assert not deployment_available(None)
    live = {
        "metadata": {"generation": 2},
        "status": {"observedGeneration": 2, "availableReplicas": 1},
    }
    assert deployment_available(live)
    assert not deployment_available(
        {**live, "status": {"observedGeneration": 1, "availableReplicas": 1}}
    )
    assert not deployment_available({**live, "status": {"observedGeneration": 2}})


# -- status merges ---------------------------------------------------------------------------


def cond(type_: str, status: str, reason: str = "R", since: str = "") -> Obj:
    out = {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": "",
        "observedGeneration": 1,
    }
    if since:
        out["lastTransitionTime"] = since
    return out


def test_transition_time_moves_only_when_status_flips() -> None:
    old = [cond("Accepted", "True", since="t0"), cond("Programmed", "False", since="t0")]
    new = gs.stamp_conditions(
        [cond("Accepted", "True", "Other"), cond("Programmed", "True")], old, "t1"
    )
    assert [x["lastTransitionTime"] for x in new] == ["t0", "t1"]
    status = gs.stamp_gateway_status(
        {"conditions": [cond("Accepted", "True")], "listeners": [{"name": "l0", "conditions": [cond("Programmed", "True")]}]},
        {"conditions": [cond("Accepted", "True", since="t0")], "listeners": [{"name": "l0", "conditions": [cond("Programmed", "True", since="t0")]}]},
        "t1",
    )  # fmt: skip
    assert status["conditions"][0]["lastTransitionTime"] == "t0"
    assert status["listeners"][0]["conditions"][0]["lastTransitionTime"] == "t0"


def test_parents_keep_other_controllers_entries_and_replace_ours() -> None:
    other_gw: Obj = {
        "parentRef": {"name": "theirs"},
        "controllerName": "example.com/gw",
        "conditions": [],
    }
    standalone: Obj = {
        "parentRef": dict(c.OPERATOR_PARENT_REF),
        "controllerName": c.CONTROLLER_NAME,
        "conditions": [],
    }
    stale: Obj = {
        "parentRef": {"name": "gone", "namespace": "ns"},
        "controllerName": GATEWAY_CONTROLLER_NAME,
        "conditions": [],
    }
    ours_before = {
        "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw", "namespace": "ns"},
        "controllerName": GATEWAY_CONTROLLER_NAME,
        "conditions": [cond("Accepted", "True", since="t0")],
    }  # fmt: skip
    live: list[Obj] = [standalone, other_gw, stale, ours_before]
    wanted = [{"parentRef": {"name": "gw"}, "conditions": [cond("Accepted", "True")]}]
    merged = gs.merge_parents(live, wanted, "ns", "t1")
    assert merged[:2] == [standalone, other_gw]
    (mine,) = merged[2:]
    assert mine["controllerName"] == GATEWAY_CONTROLLER_NAME
    assert mine["conditions"][0]["lastTransitionTime"] == "t0"  # matched despite defaults
    assert gs.merge_parents(live, [], "ns", "t1") == [standalone, other_gw]


def test_unchanged_ignores_server_defaults_and_patch_removes_dropped_fields() -> None:
    want = {"parents": [{"parentRef": {"name": "gw"}, "conditions": []}]}
    live = {
        "parents": [
            {"parentRef": {"name": "gw", "group": "gateway.networking.k8s.io"}, "conditions": []}
        ]
    }
    assert gs.unchanged(want, live)
    assert not gs.unchanged({"parents": []}, live)
    assert gs.status_patch({"conditions": []}, {"conditions": [], "addresses": [1]}) == {
        "conditions": [],
        "addresses": None,
    }


# -- one sync pass ---------------------------------------------------------------------------


class RecordingKube:
    """The calls GatewaySync makes, answered from a dict of live objects."""

    def __init__(self) -> None:
        self.live: dict[tuple[str, str, str], Obj] = {}
        self.calls: list[str] = []
        self.conflict = False

    def get(self, kind: str, namespace: str | None, name: str) -> Obj | None:
        self.calls.append(f"get {kind} {name}")
        return copy.deepcopy(self.live.get((kind, namespace or "", name)))

    def apply(self, obj: Obj) -> Obj:
        self.calls.append(f"apply {obj['kind']} {obj['metadata']['name']}")
        self.live[(obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj
        return obj

    def delete(self, kind: str, namespace: str | None, name: str, uid: str | None = None) -> bool:
        self.calls.append(f"delete {kind} {name}")
        return self.live.pop((kind, namespace or "", name), None) is not None

    def patch_status(
        self, kind: str, namespace: str, name: str, status: Obj, resource_version: str = ""
    ) -> Obj:
        if self.conflict:
            raise KubeError(409, "PATCH", name, "conflict")
        self.calls.append(f"status {kind} {name}")
        return {}


def _sync(kube: RecordingKube) -> GatewaySync:
    return GatewaySync(kube, GatewaySettings(), OperatorSettings(), lambda gateway: PROXY)  # type: ignore[arg-type]


def _translation(gw: Obj, status: Obj | None = None) -> Translation:
    key = ("ns", gw["metadata"]["name"])
    return Translation(
        snapshots={key: Snapshot(resources={})},
        gateway_status={key: status or {"conditions": [cond("Accepted", "True")]}},
    )


def test_sync_applies_then_skips_what_is_up_to_date() -> None:
    kube = RecordingKube()
    sync = _sync(kube)
    gw = gateway()
    objects = ClusterObjects(gateways=(gw,))
    result = sync.sync(objects, _translation(gw), {})
    assert result.applied == [
        "ConfigMap ns/gw-infergate",
        "Deployment ns/gw-infergate",
        "Service ns/gw-infergate",
    ]
    assert result.statuses == ["Gateway ns/gw"]
    # The watches now show the objects (and the status): nothing to write.
    proxies = {(k, ns, n): o for (k, ns, n), o in kube.live.items() if k != "ConfigMap"}
    gw_now = {**gw, "status": {"conditions": [cond("Accepted", "True", since="t")]}}
    kube.calls.clear()
    again = sync.sync(ClusterObjects(gateways=(gw_now,)), _translation(gw), proxies)
    assert not again and kube.calls == []


def test_sync_never_takes_over_an_object_it_does_not_own() -> None:
    kube = RecordingKube()
    gw = gateway()
    foreign = {
        "kind": "Service",
        "metadata": {"name": "gw-infergate", "namespace": "ns", "ownerReferences": []},
    }
    result = _sync(kube).sync(
        ClusterObjects(gateways=(gw,)),
        _translation(gw),
        {("Service", "ns", "gw-infergate"): foreign},
    )
    assert "Service ns/gw-infergate" in result.conflicts
    assert "apply Service gw-infergate" not in kube.calls


def test_sync_prunes_the_proxy_of_a_gateway_no_longer_served() -> None:
    kube = RecordingKube()
    sync = _sync(kube)
    gw = gateway()
    sync.sync(ClusterObjects(gateways=(gw,)), _translation(gw), {})
    proxies = {(k, ns, n): o for (k, ns, n), o in kube.live.items() if k != "ConfigMap"}
    result = sync.sync(ClusterObjects(gateways=(gw,)), Translation(), proxies)
    assert sorted(result.deleted) == [
        "ConfigMap ns/gw-infergate",
        "Deployment ns/gw-infergate",
        "Service ns/gw-infergate",
    ]
    assert not kube.live


def test_a_status_conflict_asks_for_another_pass() -> None:
    kube = RecordingKube()
    kube.conflict = True
    gw = gateway()
    result = _sync(kube).sync(ClusterObjects(gateways=(gw,)), _translation(gw), {})
    assert result.retry and result.conflicts == ["Gateway ns/gw (409)"]


@pytest.mark.parametrize("kind", ["HTTPRoute", c.POOL_KIND])
def test_route_and_pool_parents_written_only_with_something_of_ours(kind: str) -> None:
    kube = RecordingKube()
    obj: Obj = {"kind": kind, "metadata": {"name": "x", "namespace": "ns", "resourceVersion": "1"}, "status": {"parents": [{"parentRef": {"name": "o"}, "controllerName": "example.com/gw", "conditions": []}]}}  # fmt: skip
    field = "http_routes" if kind == "HTTPRoute" else "inference_pools"
    objects = ClusterObjects(**{field: (obj,)})  # type: ignore[arg-type]
    assert not _sync(kube).sync(objects, Translation(), {})
    parents = {
        ("ns", "x"): [{"parentRef": {"name": "gw"}, "conditions": [cond("Accepted", "True")]}]
    }
    translation = (
        Translation(route_parents=parents)
        if kind == "HTTPRoute"
        else Translation(pool_parents=parents)
    )
    result = _sync(kube).sync(objects, translation, {})
    assert result.statuses == [f"{kind} ns/x"]


def test_a_proxy_the_api_server_refuses_does_not_hold_up_the_rest() -> None:
    """One Gateway's Deployment refused (say, by an admission policy): the other Gateway's
    proxy is applied and both statuses are written; a 422 is not retried in a loop."""

    class Refusing(RecordingKube):
        def apply(self, obj: Obj) -> Obj:
            if obj["metadata"]["name"] == "bad-infergate":
                raise KubeError(422, "PATCH", obj["metadata"]["name"], "denied")
            return super().apply(obj)

    kube = Refusing()
    bad, good = gateway("bad"), gateway("good")
    translation = Translation(
        snapshots={("ns", "bad"): Snapshot(resources={}), ("ns", "good"): Snapshot(resources={})},
        gateway_status={
            ("ns", "bad"): {"conditions": [cond("Accepted", "True")]},
            ("ns", "good"): {"conditions": [cond("Accepted", "True")]},
        },
    )
    result = _sync(kube).sync(ClusterObjects(gateways=(bad, good)), translation, {})
    assert len(result.errors) == 1 and "ns/bad" in result.errors[0] and not result.retry
    assert "apply Deployment good-infergate" in kube.calls
    assert {"status Gateway bad", "status Gateway good"} <= set(kube.calls)
