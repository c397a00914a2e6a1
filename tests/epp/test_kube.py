"""Pool mode on a real API server (the cluster tier): the in-process EPP watches the pool,
its pods (run by kwok) and the policy objects through the admin kubeconfig."""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from infergate.epp.datalayer.discovery.kube import READ_TIMEOUT, pool_endpoints

from tests.support.controlplane import Cluster

from .conftest import eventually

ROOT = Path(__file__).resolve().parents[2]
POOL = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())


@pytest.fixture
def namespace(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh namespace with the CRDs installed, and the admin kubeconfig for the EPP."""
    for crd in sorted((ROOT / "crds").glob("*.yaml")):
        if crd.name != "kustomization.yaml":
            cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
    name = f"epp-kube-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


async def kubectl(cluster: Cluster, *args: str, stdin: Any = None) -> str:
    """``kubectl`` off the event loop (the in-process EPP's watches run on it)."""
    body = None if stdin is None else json.dumps(stdin)
    result = await asyncio.to_thread(cluster.kubectl, *args, stdin=body)
    return str(result.stdout)


async def add_pod(cluster: Cluster, namespace: str, name: str, labels: dict[str, str]) -> str:
    """A pod kwok runs (no process behind it); returns its IP once it has one."""
    await kubectl(cluster, "apply", "-n", namespace, "-f", "-", stdin={
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "registry.example/engine:test"}]},
    })  # fmt: skip
    for _ in range(600):
        pod = json.loads(await kubectl(cluster, "get", "pod", name, "-n", namespace, "-o", "json"))
        ready = any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in pod["status"].get("conditions") or []
        )
        if pod["status"].get("podIP") and ready:
            return str(pod["status"]["podIP"])
        await asyncio.sleep(0.1)
    raise AssertionError(f"pod {name} got no IP")


def keys(epp: Any) -> set[str]:
    return {s.key for s in epp.datastore.all()}


@pytest.mark.cluster
async def test_pool_mode_tracks_ready_pods_ports_and_objectives(
    cluster: Cluster, namespace: str, epp_factory: Any
) -> None:
    pool = copy.deepcopy(POOL)
    pool["metadata"]["namespace"] = namespace
    pool["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8001}]
    await kubectl(cluster, "apply", "-f", "-", stdin=pool)
    ip0 = await add_pod(cluster, namespace, "engine-0", {"app": "qwen-engine"})
    await add_pod(cluster, namespace, "other", {"app": "unrelated"})
    epp = await epp_factory(
        pool_name="qwen-pool", pool_namespace=namespace, refresh_metrics_interval=5.0
    )
    await eventually(lambda: keys(epp) == {f"{ip0}:8000", f"{ip0}:8001"}, timeout=30)

    # A pod turns NotReady (what a failing readiness probe makes the kubelet write): dropped.
    ip1 = await add_pod(cluster, namespace, "engine-1", {"app": "qwen-engine"})
    await eventually(lambda: f"{ip1}:8000" in keys(epp), timeout=30)
    not_ready = {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    await kubectl(cluster, "patch", "pod", "engine-1", "-n", namespace, "--subresource=status",
                  "--type=strategic", "-p", json.dumps(not_ready))  # fmt: skip
    await eventually(lambda: f"{ip1}:8000" not in keys(epp), timeout=30)
    # (Deleted now, so kwok's own stages cannot make it Ready again under the checks below.)
    await kubectl(cluster, "delete", "pod", "engine-1", "-n", namespace, "--wait=false")
    sglang = {"app": "qwen-engine", "inference.networking.k8s.io/engine-type": "sglang"}
    ip2 = await add_pod(cluster, namespace, "engine-2", sglang)
    await eventually(lambda: f"{ip2}:8000" in keys(epp), timeout=30)
    await kubectl(cluster, "delete", "pod", "engine-0", "-n", namespace, "--wait=false")
    await eventually(lambda: keys(epp) == {f"{ip2}:8000", f"{ip2}:8001"}, timeout=30)

    # Watches idle past the client read timeout are re-opened and still deliver.
    await asyncio.sleep(READ_TIMEOUT + 1)
    ip3 = await add_pod(cluster, namespace, "engine-3", {"app": "qwen-engine"})
    await eventually(lambda: f"{ip3}:8000" in keys(epp), timeout=30)

    objective = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"name": "batch", "namespace": namespace},
        "spec": {"priority": -5, "poolRef": {"name": "qwen-pool"}},
    }
    rewrite = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferenceModelRewrite",
        "metadata": {"name": "alias", "namespace": namespace},
        "spec": {
            "poolRef": {"name": "qwen-pool"},
            "rules": [
                {
                    "matches": [{"model": {"value": "qwen"}}],
                    "targets": [{"modelRewrite": "qwen-v2", "weight": 1}],
                }
            ],
        },
    }
    for body in (objective, rewrite):
        await kubectl(cluster, "apply", "-f", "-", stdin=body)
    await eventually(lambda: epp.objectives.priority("batch") == -5, timeout=30)
    await eventually(lambda: epp.objectives.rewrite("qwen") == "qwen-v2", timeout=30)

    await kubectl(cluster, "delete", "inferencepool", "qwen-pool", "-n", namespace)
    await eventually(lambda: keys(epp) == set(), timeout=30)


def test_pool_endpoints_rules() -> None:
    ready = {"type": "Ready", "status": "True"}
    pods = {
        "a": {
            "metadata": {"name": "a", "labels": {"app": "x"}},
            "status": {"podIP": "1.1.1.1", "conditions": [ready]},
        },
        "gone": {
            "metadata": {"name": "gone", "labels": {"app": "x"}, "deletionTimestamp": "now"},
            "status": {"podIP": "1.1.1.2", "conditions": [ready]},
        },
        "noip": {
            "metadata": {"name": "noip", "labels": {"app": "x"}},
            "status": {"conditions": [ready]},
        },
    }
    pool = {"spec": {"selector": {"matchLabels": {"app": "x"}}, "targetPorts": [{"number": 1}]}}
    assert [e.key for e in pool_endpoints(pool, pods)] == ["1.1.1.1:1"]
    assert pool_endpoints(None, pods) == []
