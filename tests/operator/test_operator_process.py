"""The operator as a real process (`infergate operator`) against the KMock-based API server.

Each test drives the API the way a user and the cluster's controllers would (create,
patch, delete; Deployment availability; pods turning Ready) and asserts on what the
operator wrote: objects, status, Events, and the count of its write requests.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from infergate.testing.kube_emulator import KubeEmulator, pool_conditions, wait_for

ROOT = Path(__file__).resolve().parents[2]
POOL = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())
NS = "default"
EPP = "qwen-pool-epp"
OWNED = ("ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Deployment", "Service")


def pool(**annotations: str) -> dict[str, Any]:
    body = copy.deepcopy(POOL)
    if annotations:
        body["metadata"]["annotations"] = annotations
    return body


def owned(emu: KubeEmulator, kind: str, name: str = EPP) -> dict[str, Any] | None:
    return emu.get_object(kind, NS, name)


def ready_endpoints(emu: KubeEmulator, name: str = "qwen-pool") -> int | None:
    body = emu.get_object("InferencePool", NS, name) or {}
    parents = (body.get("status") or {}).get("parents") or [{}]
    value = parents[0].get("readyEndpoints")
    return int(value) if value is not None else None


def status_is(emu: KubeEmulator, name: str = "qwen-pool", **expected: str) -> bool:
    conds = pool_conditions(emu, name)
    return all(
        t in conds and f"{conds[t]['status']}/{conds[t]['reason']}" == v
        for t, v in expected.items()
    )


async def test_pool_lifecycle(emulator: KubeEmulator, start_operator: Any) -> None:
    operator = await start_operator()
    created = await emulator.create_object(pool())
    uid = created["metadata"]["uid"]

    # Apply → every owned object appears, owned by the pool, with the right specs.
    await wait_for(lambda: all(owned(emulator, k) for k in OWNED), what="owned objects")
    for kind in OWNED:
        refs = owned(emulator, kind)["metadata"]["ownerReferences"]  # type: ignore[index]
        assert refs == [
            {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
             "name": "qwen-pool", "uid": uid, "controller": True, "blockOwnerDeletion": True}
        ]  # fmt: skip
    deployment = owned(emulator, "Deployment")
    assert deployment is not None
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.example/infergate-epp:test"
    assert container["args"][:5] == ["epp", "--pool-name", "qwen-pool", "--pool-namespace", NS]
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    service = owned(emulator, "Service")
    assert service is not None
    assert {(p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        (9002, 9002),
        (9090, 9090),
    }
    config = owned(emulator, "ConfigMap")
    assert config is not None and "kind: EndpointPickerConfig" in config["data"]["config.yaml"]
    assert owned(emulator, "PodDisruptionBudget") is None  # one replica: no PDB

    # Status: accepted and resolved, not ready until the Deployment is available.
    await wait_for(
        lambda: status_is(
            emulator, Accepted="True/Accepted", ResolvedRefs="True/ResolvedRefs",
            Ready="False/EndpointPickerUnavailable",
        ),
        what="initial status",
    )  # fmt: skip
    first = pool_conditions(emulator, "qwen-pool")
    assert first["Accepted"]["observedGeneration"] == 1

    # The cluster catches up: EPP available, two engine pods Ready → Ready=True, count 2.
    await emulator.set_deployment_available(NS, EPP)
    await emulator.add_pod(NS, "engine-0", {"app": "qwen-engine"}, ip="10.0.0.10")
    await emulator.add_pod(NS, "engine-1", {"app": "qwen-engine"}, ip="10.0.0.11")
    await emulator.add_pod(NS, "other", {"app": "unrelated"}, ip="10.0.0.12")
    await wait_for(
        lambda: (
            status_is(emulator, Ready="True/EndpointPickerAvailable")
            and ready_endpoints(emulator) == 2
        ),
        what="Ready with 2 endpoints",
    )
    now = pool_conditions(emulator, "qwen-pool")
    # Unchanged statuses keep their transition time.
    assert now["Accepted"]["lastTransitionTime"] == first["Accepted"]["lastTransitionTime"]
    reasons = {e["reason"] for e in emulator.list_objects("Event", NS)}
    # Structured logs: one JSON object per line, with the reconcile's facts as fields.
    import json

    records = [
        json.loads(line) for line in operator.log_tail(200_000).splitlines() if line.startswith("{")
    ]
    reconciled = [r for r in records if r.get("pool") == "qwen-pool" and "applied" in r]
    assert reconciled and reconciled[0]["applied"] and reconciled[0]["namespace"] == NS
    assert {"Applied", "EndpointPickerAvailable"} <= reasons

    # Change → patched: two replicas (and a PDB), a new picker port.
    await emulator.patch_object(
        "InferencePool", NS, "qwen-pool",
        {"metadata": {"annotations": {"infergate.io/epp-replicas": "2"}},
         "spec": {"endpointPickerRef": {"port": {"number": 9012}}}},
    )  # fmt: skip
    await wait_for(lambda: owned(emulator, "PodDisruptionBudget"), what="PDB")
    assert owned(emulator, "Deployment")["spec"]["replicas"] == 2  # type: ignore[index]
    await wait_for(
        lambda: 9012 in [p["port"] for p in owned(emulator, "Service")["spec"]["ports"]],  # type: ignore[index]
        what="service port 9012",
    )
    await wait_for(
        lambda: pool_conditions(emulator, "qwen-pool")["ResolvedRefs"]["observedGeneration"] == 2,
        what="status for generation 2",
    )
    # Back to one replica → the PDB is pruned.
    await emulator.patch_object(
        "InferencePool",
        NS,
        "qwen-pool",
        {"metadata": {"annotations": {"infergate.io/epp-replicas": None}}},
    )
    await wait_for(lambda: owned(emulator, "PodDisruptionBudget") is None, what="PDB pruned")

    # Delete → everything it owned goes (owner-reference garbage collection).
    await emulator.delete_object("InferencePool", NS, "qwen-pool")
    await wait_for(lambda: not any(owned(emulator, k) for k in OWNED), what="owned objects gone")


async def test_a_service_the_user_owns_is_resolved_not_replaced(
    emulator: KubeEmulator, start_operator: Any
) -> None:
    await start_operator()
    await emulator.create_object(
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": EPP, "namespace": NS},
         "spec": {"selector": {"app": "my-epp"}, "ports": [{"name": "grpc", "port": 9002}]}}
    )  # fmt: skip
    await emulator.create_object(pool())
    await wait_for(
        lambda: status_is(
            emulator, Accepted="True/Accepted", ResolvedRefs="True/ResolvedRefs",
            Ready="Unknown/ExternalEndpointPicker",
        ),
        what="external picker status",
    )  # fmt: skip
    assert owned(emulator, "Deployment") is None
    assert owned(emulator, "Service")["spec"]["selector"] == {"app": "my-epp"}  # type: ignore[index]

    # A non-Service picker kind is not something infergate can deploy.
    other = pool()
    other["metadata"]["name"] = "custom"
    other["spec"]["endpointPickerRef"] = {"group": "example.com", "kind": "Picker", "name": "p"}
    await emulator.create_object(other)
    await wait_for(
        lambda: status_is(emulator, "custom", ResolvedRefs="False/InvalidExtensionRef"),
        what="InvalidExtensionRef",
    )


async def test_standalone_envoy_sidecar(emulator: KubeEmulator, start_operator: Any) -> None:
    pytest.importorskip("infergate.envoy.bootstrap", reason="envoy_config not built yet")
    await start_operator()
    await emulator.create_object(pool(**{"infergate.io/standalone-envoy": "true"}))
    await wait_for(lambda: owned(emulator, "Deployment"), what="deployment")
    containers = owned(emulator, "Deployment")["spec"]["template"]["spec"]["containers"]  # type: ignore[index]
    assert [c["name"] for c in containers] == ["epp", "envoy"]
    envoy_cm = await wait_for(
        lambda: owned(emulator, "ConfigMap", f"{EPP}-envoy"), what="envoy config"
    )
    bootstrap = yaml.safe_load(envoy_cm["data"]["envoy.yaml"])
    assert "static_resources" in bootstrap
    # The Service is applied after the Deployment and both ConfigMaps: wait for it too.
    service = await wait_for(lambda: owned(emulator, "Service"), what="service")
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert ports["http"] == 8081
    # Switching it off removes the sidecar and prunes its ConfigMap.
    await emulator.patch_object(
        "InferencePool", NS, "qwen-pool",
        {"metadata": {"annotations": {"infergate.io/standalone-envoy": "false"}}},
    )  # fmt: skip
    await wait_for(
        lambda: owned(emulator, "ConfigMap", f"{EPP}-envoy") is None, what="envoy config pruned"
    )


async def test_drift_is_repaired_and_a_renamed_picker_moves_everything(
    emulator: KubeEmulator, start_operator: Any
) -> None:
    await start_operator()
    await emulator.create_object(pool())
    await wait_for(lambda: all(owned(emulator, k) for k in OWNED), what="owned objects")

    # Someone scales the EPP by hand: the Deployment's watch event brings it back.
    await emulator.patch_object("Deployment", NS, EPP, {"spec": {"replicas": 5}})
    await wait_for(
        lambda: (owned(emulator, "Deployment") or {}).get("spec", {}).get("replicas") == 1,
        what="drift repaired",
    )
    # Someone deletes the Service: recreated.
    await emulator.delete_object("Service", NS, EPP)
    await wait_for(lambda: owned(emulator, "Service"), what="Service recreated")

    # The pool now names another picker: new objects appear, the old ones are pruned.
    await emulator.patch_object(
        "InferencePool", NS, "qwen-pool", {"spec": {"endpointPickerRef": {"name": "renamed-epp"}}}
    )
    await wait_for(
        lambda: all(owned(emulator, k, "renamed-epp") for k in OWNED), what="renamed objects"
    )
    await wait_for(lambda: not any(owned(emulator, k) for k in OWNED), what="old objects pruned")
    rolebinding = owned(emulator, "RoleBinding", "renamed-epp")
    assert rolebinding is not None and rolebinding["subjects"][0]["name"] == "renamed-epp"
