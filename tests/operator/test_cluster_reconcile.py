"""What the operator writes for a pool, on a real API server (the cluster tier).

The operator process runs with the chart's ServiceAccount token, and the real controllers (the
controller-manager, and kwok for the pods) stand in for the cluster. So a Deployment's
availability and the engine pods' readiness come from Kubernetes itself, not from a
test helper.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from infergate.procs import ProcessGroup
from tests.support.controlplane import Cluster

from .test_cluster import run_operator, wait_for

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
POOL = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())
EPP = "qwen-pool-epp"
OWNED = ("configmap", "serviceaccount", "role", "rolebinding", "deployment", "service")


def apply(cluster: Cluster, body: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(body))


def pool(namespace: str, **annotations: str) -> dict[str, Any]:
    body = copy.deepcopy(POOL)
    body["metadata"]["namespace"] = namespace
    if annotations:
        body["metadata"]["annotations"] = annotations
    return body


def patch(cluster: Cluster, kind: str, name: str, namespace: str, body: dict[str, Any]) -> None:
    cluster.kubectl("patch", kind, name, "-n", namespace, "--type=merge", "-p", json.dumps(body))


def spec(cluster: Cluster, kind: str, namespace: str, name: str = EPP) -> dict[str, Any]:
    """The object's spec, or {} while it does not exist."""
    return (cluster.get(kind, name, namespace) or {}).get("spec") or {}


def ports(cluster: Cluster, namespace: str) -> dict[str, int]:
    """The EPP Service's ports by name ({} while it does not exist)."""
    return {
        p.get("name", ""): p["port"] for p in spec(cluster, "service", namespace).get("ports", [])
    }


def containers(cluster: Cluster, namespace: str) -> list[str]:
    """The EPP Deployment's container names."""
    template = spec(cluster, "deployment", namespace).get("template") or {}
    return [c["name"] for c in (template.get("spec") or {}).get("containers") or []]


def conditions(cluster: Cluster, namespace: str, name: str = "qwen-pool") -> dict[str, Any]:
    body = cluster.get("inferencepool", name, namespace) or {}
    for parent in (body.get("status") or {}).get("parents") or []:
        return {c["type"]: c for c in parent.get("conditions") or []}
    return {}


def status_is(cluster: Cluster, namespace: str, name: str = "qwen-pool", **want: str) -> bool:
    conds = conditions(cluster, namespace, name)
    return all(
        t in conds and f"{conds[t]['status']}/{conds[t]['reason']}" == v for t, v in want.items()
    )


def ready_endpoints(cluster: Cluster, namespace: str) -> int | None:
    body = cluster.get("inferencepool", "qwen-pool", namespace) or {}
    parents = (body.get("status") or {}).get("parents") or [{}]
    value = parents[0].get("readyEndpoints")
    return int(value) if value is not None else None


def deployment(name: str, namespace: str, labels: dict[str, str], replicas: int) -> dict[str, Any]:
    """A Deployment whose pods kwok runs (no process behind them: only their status counts)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "c", "image": "registry.example/engine:test"}]},
            },
        },
    }


@pytest.fixture
def namespace(
    installed: tuple[str, Path], processes: ProcessGroup, infergate_cli: list[str]
) -> str:
    """The chart's namespace, with the operator running on the chart's token."""
    namespace, sa_kubeconfig = installed
    run_operator(processes, infergate_cli, sa_kubeconfig, namespace, "operator")
    return namespace


def test_owned_objects_status_and_ready_endpoints(cluster: Cluster, namespace: str) -> None:
    apply(cluster, pool(namespace))
    created = cluster.get("inferencepool", "qwen-pool", namespace)
    assert created is not None
    uid = created["metadata"]["uid"]

    # Every owned object appears, controlled by the pool, with the specs it needs.
    for kind in OWNED:
        obj = wait_for(functools.partial(cluster.get, kind, EPP, namespace), f"the EPP {kind}")
        assert obj["metadata"]["ownerReferences"] == [
            {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
             "name": "qwen-pool", "uid": uid, "controller": True, "blockOwnerDeletion": True}
        ]  # fmt: skip
    epp = cluster.get("deployment", EPP, namespace)
    assert epp is not None
    container = epp["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.example/infergate-epp:test"
    assert container["args"][:5] == [
        "epp",
        "--pool-name",
        "qwen-pool",
        "--pool-namespace",
        namespace,
    ]
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    service = cluster.get("service", EPP, namespace)
    assert service is not None
    assert {(p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        (9002, 9002),
        (9090, 9090),
    }
    config = cluster.get("configmap", EPP, namespace)
    assert config is not None and "kind: EndpointPickerConfig" in config["data"]["config.yaml"]
    assert cluster.get("poddisruptionbudget", EPP, namespace) is None  # one replica: no PDB

    # kwok runs the EPP pod and two engine pods; an unrelated pod does not count.
    apply(cluster, deployment("qwen-engine", namespace, {"app": "qwen-engine"}, 2))
    apply(cluster, deployment("other", namespace, {"app": "unrelated"}, 1))
    wait_for(
        lambda: status_is(
            cluster, namespace, Accepted="True/Accepted", ResolvedRefs="True/ResolvedRefs",
            Ready="True/EndpointPickerAvailable",
        ) and ready_endpoints(cluster, namespace) == 2,
        "Ready with 2 endpoints",
    )  # fmt: skip
    first = conditions(cluster, namespace)
    assert first["Accepted"]["observedGeneration"] == 1
    events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)
    reasons = {e["reason"] for e in events["items"]}
    assert {"Applied", "EndpointPickerAvailable"} <= reasons

    # A change is patched in: two replicas (and a PDB), a new picker port.
    patch(cluster, "inferencepool", "qwen-pool", namespace, {
        "metadata": {"annotations": {"infergate.io/epp-replicas": "2"}},
        "spec": {"endpointPickerRef": {"port": {"number": 9012}}},
    })  # fmt: skip
    wait_for(functools.partial(cluster.get, "poddisruptionbudget", EPP, namespace), "the EPP's PDB")
    wait_for(lambda: spec(cluster, "deployment", namespace).get("replicas") == 2, "2 replicas")
    wait_for(lambda: 9012 in ports(cluster, namespace).values(), "service port 9012")
    wait_for(
        lambda: (
            conditions(cluster, namespace).get("ResolvedRefs", {}).get("observedGeneration") == 2
        ),
        "status for generation 2",
    )
    # An unchanged status keeps its transition time.
    assert (
        conditions(cluster, namespace)["Accepted"]["lastTransitionTime"]
        == first["Accepted"]["lastTransitionTime"]
    )
    # Back to one replica: the PDB is pruned.
    patch(cluster, "inferencepool", "qwen-pool", namespace,
          {"metadata": {"annotations": {"infergate.io/epp-replicas": None}}})  # fmt: skip
    wait_for(lambda: cluster.get("poddisruptionbudget", EPP, namespace) is None, "the PDB pruned")


def test_a_service_the_user_owns_is_resolved_not_replaced(cluster: Cluster, namespace: str) -> None:
    apply(cluster, {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": EPP, "namespace": namespace},
        "spec": {"selector": {"app": "my-epp"}, "ports": [{"name": "grpc", "port": 9002}]},
    })  # fmt: skip
    apply(cluster, pool(namespace))
    wait_for(
        lambda: status_is(
            cluster, namespace, Accepted="True/Accepted", ResolvedRefs="True/ResolvedRefs",
            Ready="Unknown/ExternalEndpointPicker",
        ),
        "the external picker's status",
    )  # fmt: skip
    assert cluster.get("deployment", EPP, namespace) is None
    assert spec(cluster, "service", namespace)["selector"] == {"app": "my-epp"}

    # A picker that is not a core Service is not something infergate can deploy.
    other = pool(namespace)
    other["metadata"]["name"] = "custom"
    other["spec"]["endpointPickerRef"] = {"group": "example.com", "kind": "Picker", "name": "p"}
    apply(cluster, other)
    wait_for(
        lambda: status_is(cluster, namespace, "custom", ResolvedRefs="False/InvalidExtensionRef"),
        "InvalidExtensionRef",
    )


def test_drift_standalone_envoy_and_a_renamed_picker(cluster: Cluster, namespace: str) -> None:
    apply(cluster, pool(namespace))
    for kind in OWNED:
        wait_for(functools.partial(cluster.get, kind, EPP, namespace), f"the EPP {kind}")

    # Someone scales the EPP by hand: the Deployment's watch event brings it back.
    cluster.kubectl("scale", "deployment", EPP, "-n", namespace, "--replicas=5")
    wait_for(lambda: spec(cluster, "deployment", namespace).get("replicas") == 1, "drift repaired")
    # Someone deletes the Service: it is recreated.
    cluster.kubectl("delete", "service", EPP, "-n", namespace)
    wait_for(functools.partial(cluster.get, "service", EPP, namespace), "the Service recreated")

    # The standalone Envoy: a second container, its bootstrap, the client port.
    cluster.kubectl("annotate", "--overwrite", "inferencepool", "qwen-pool", "-n", namespace,
                    "infergate.io/standalone-envoy=true")  # fmt: skip
    envoy_config = wait_for(
        functools.partial(cluster.get, "configmap", f"{EPP}-envoy", namespace), "envoy config"
    )
    assert "static_resources" in yaml.safe_load(envoy_config["data"]["envoy.yaml"])
    wait_for(lambda: containers(cluster, namespace) == ["epp", "envoy"], "the envoy container")
    wait_for(lambda: ports(cluster, namespace).get("http") == 8081, "the Service's http port")
    # Switched off: the sidecar goes and its ConfigMap is pruned.
    cluster.kubectl("annotate", "--overwrite", "inferencepool", "qwen-pool", "-n", namespace,
                    "infergate.io/standalone-envoy=false")  # fmt: skip
    wait_for(
        lambda: cluster.get("configmap", f"{EPP}-envoy", namespace) is None, "envoy config pruned"
    )
    wait_for(lambda: containers(cluster, namespace) == ["epp"], "the envoy container removed")

    # The pool names another picker: new objects appear, the old ones are pruned.
    patch(cluster, "inferencepool", "qwen-pool", namespace,
          {"spec": {"endpointPickerRef": {"name": "renamed-epp"}}})  # fmt: skip
    for kind in OWNED:
        wait_for(
            functools.partial(cluster.get, kind, "renamed-epp", namespace), f"the renamed {kind}"
        )
    wait_for(
        lambda: not any(cluster.get(kind, EPP, namespace) for kind in OWNED), "the old ones pruned"
    )
    rolebinding = cluster.get("rolebinding", "renamed-epp", namespace)
    assert rolebinding is not None and rolebinding["subjects"][0]["name"] == "renamed-epp"
