"""The API-server behaviour the emulator adds to KMock, checked over real HTTP with the
same client the operator uses (so the operator tests rest on verified ground)."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from infergate.operator.kube import Kube, KubeError, new_api_client
from infergate.procs import ProcessGroup, free_port, tcp_ready
from infergate.testing.kube_emulator import KubeEmulator, write_kubeconfig

ROOT = Path(__file__).resolve().parents[2]
POOL = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())


def cm(name: str, **data: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": "default"},
        "data": data,
    }


@pytest.fixture
def kube(kubeconfig: Path, monkeypatch: pytest.MonkeyPatch) -> Kube:
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    return Kube(new_api_client())


async def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return await asyncio.to_thread(fn, *args, **kwargs)


async def test_server_side_apply_creates_updates_and_drops_unapplied_fields(
    emulator: KubeEmulator, kube: Kube
) -> None:
    first = await call(kube.apply, cm("c", a="1", b="2"))
    meta = first["metadata"]
    assert meta["uid"] and meta["resourceVersion"] and meta["creationTimestamp"]
    assert meta["managedFields"][0]["manager"] == "infergate"
    # Someone else adds a field; our next apply no longer sets "b".
    await emulator.patch_object("ConfigMap", "default", "c", {"data": {"other": "x"}})
    second = await call(kube.apply, cm("c", a="1"))
    assert second["data"] == {"a": "1", "other": "x"}
    # Re-applying the same thing is a no-op: same resourceVersion, no watch event.
    third = await call(kube.apply, cm("c", a="1"))
    assert third["metadata"]["resourceVersion"] == second["metadata"]["resourceVersion"]


async def test_crd_defaulting_validation_generation_and_status_subresource(
    emulator: KubeEmulator, kube: Kube
) -> None:
    bad = copy.deepcopy(POOL)
    bad["spec"]["endpointPickerRef"].pop("port")
    with pytest.raises(KubeError) as caught:
        await call(kube.apply, bad)
    assert caught.value.status == 422 and "port is required" in str(caught.value)

    pool = await call(kube.apply, copy.deepcopy(POOL))
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"  # defaulted
    assert pool["metadata"]["generation"] == 1
    rv = pool["metadata"]["resourceVersion"]
    # Status writes touch only status and do not bump generation.
    status = {
        "parents": [
            {"parentRef": {"group": "g.io", "kind": "Gateway", "name": "x"}, "conditions": []}
        ]
    }
    updated = await call(kube.patch_status, "InferencePool", "default", "qwen-pool", status, rv)
    assert updated["status"] == status and updated["metadata"]["generation"] == 1
    # A stale resourceVersion is a conflict.
    with pytest.raises(KubeError) as conflict:
        await call(kube.patch_status, "InferencePool", "default", "qwen-pool", {"parents": []}, rv)
    assert conflict.value.status == 409
    # Main-resource writes cannot change status; spec changes bump generation.
    changed = copy.deepcopy(POOL)
    changed["spec"]["targetPorts"] = [{"number": 8001}]
    changed["status"] = {"parents": []}
    after = await call(kube.apply, changed)
    assert after["metadata"]["generation"] == 2 and after["status"] == status


async def test_label_selectors_and_owner_garbage_collection(
    emulator: KubeEmulator, kube: Kube
) -> None:
    await emulator.add_pod("default", "a", {"app": "x", "tier": "1"})
    await emulator.add_pod("default", "b", {"app": "x"})
    await emulator.add_pod("default", "c", {"app": "y"})
    names = lambda sel: sorted(p["metadata"]["name"] for p in kube.list("Pod", "default", sel))  # noqa: E731
    assert await call(names, {"app": "x"}) == ["a", "b"]
    assert await call(names, {"app": "x", "tier": "1"}) == ["a"]

    owner = await call(kube.apply, copy.deepcopy(POOL))
    ref = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "name": "qwen-pool",
           "uid": owner["metadata"]["uid"], "controller": True}  # fmt: skip
    child = cm("child")
    child["metadata"]["ownerReferences"] = [ref]
    child_uid = (await call(kube.apply, child))["metadata"]["uid"]
    grandchild = cm("grandchild")
    grandchild["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": "child",
            "uid": child_uid,
        }
    ]
    await call(kube.apply, grandchild)
    assert await call(kube.delete, "InferencePool", "default", "qwen-pool")
    assert emulator.get_object("ConfigMap", "default", "child") is None
    assert emulator.get_object("ConfigMap", "default", "grandchild") is None


async def test_finalizers_hold_deletion_until_removed(emulator: KubeEmulator) -> None:
    obj = cm("held")
    obj["metadata"]["finalizers"] = ["example.com/hold"]
    await emulator.create_object(obj)
    await emulator.delete_object("ConfigMap", "default", "held")
    held = emulator.get_object("ConfigMap", "default", "held")
    assert held is not None and held["metadata"]["deletionTimestamp"]
    await emulator.patch_object("ConfigMap", "default", "held", {"metadata": {"finalizers": None}})
    assert emulator.get_object("ConfigMap", "default", "held") is None


def test_emulator_runs_as_a_process(processes: ProcessGroup, tmp_path: Path) -> None:
    """``python -m infergate.testing.kube_emulator`` for suites that want a separate server."""
    import sys

    port = free_port()
    kubeconfig = tmp_path / "kc"
    processes.start(
        "kube-emulator",
        [sys.executable, "-m", "infergate.testing.kube_emulator", "--port", str(port),
         "--crds", str(ROOT / "crds"), "--kubeconfig", str(kubeconfig)],
        ready=tcp_ready("127.0.0.1", port), timeout=60,
    )  # fmt: skip
    write_kubeconfig(tmp_path / "same", f"http://127.0.0.1:{port}")
    import os

    os.environ["KUBECONFIG"] = str(kubeconfig)
    try:
        kube = Kube(new_api_client())
        kube.apply(copy.deepcopy(POOL))
        assert kube.get("InferencePool", "default", "qwen-pool") is not None
        kube.call("POST", "/api/v1/namespaces", body={"metadata": {"name": "team-a"}})
        assert kube.call("GET", "/api/v1/namespaces/team-a")["metadata"]["name"] == "team-a"
    finally:
        del os.environ["KUBECONFIG"]


async def test_kmock_reactions_still_take_precedence(emulator: KubeEmulator, kube: Kube) -> None:
    """The fast path serves resources directly only while no reaction is registered."""
    await emulator.create_object(cm("x", a="1"))
    assert (await call(kube.get, "ConfigMap", "default", "x"))["data"] == {"a": "1"}
    emulator["get /api/v1/namespaces/default/configmaps/x"] << {"data": {"from": "reaction"}}
    assert (await call(kube.get, "ConfigMap", "default", "x"))["data"] == {"from": "reaction"}
