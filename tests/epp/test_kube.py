"""Pool mode against the KMock-based Kubernetes API emulator (real HTTP, real watches)."""

from __future__ import annotations

import asyncio
import copy
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import yaml
from infergate.epp.datalayer.discovery.kube import READ_TIMEOUT, pool_endpoints

from infergate.testing.kube_emulator import KubeEmulator, serve_emulator, write_kubeconfig

from .conftest import eventually

ROOT = Path(__file__).resolve().parents[2]
POOL = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())


@pytest_asyncio.fixture
async def emulator() -> AsyncIterator[KubeEmulator]:
    async with serve_emulator([ROOT / "crds"]) as emu:
        yield emu


@pytest.fixture
def kubeconfig(emulator: KubeEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = write_kubeconfig(tmp_path / "kubeconfig", str(emulator.url))
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return path


def keys(epp) -> set[str]:
    return {s.key for s in epp.datastore.all()}


async def test_pool_mode_tracks_ready_pods_ports_and_objectives(
    emulator, kubeconfig, epp_factory
) -> None:
    pool = copy.deepcopy(POOL)
    pool["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8001}]
    await emulator.create_object(pool)
    await emulator.add_pod("default", "engine-0", {"app": "qwen-engine"}, ip="10.0.0.10")
    await emulator.add_pod("default", "other", {"app": "unrelated"}, ip="10.0.0.12")
    epp = await epp_factory(
        pool_name="qwen-pool", pool_namespace="default", refresh_metrics_interval=5.0
    )
    await eventually(lambda: keys(epp) == {"10.0.0.10:8000", "10.0.0.10:8001"}, timeout=30)

    await emulator.add_pod(
        "default", "engine-1", {"app": "qwen-engine"}, ip="10.0.0.11", ready=False
    )
    await emulator.add_pod(
        "default",
        "engine-2",
        {"app": "qwen-engine", "inference.networking.k8s.io/engine-type": "sglang"},
        ip="10.0.0.13",
    )
    await eventually(lambda: "10.0.0.13:8000" in keys(epp), timeout=30)
    assert "10.0.0.11:8000" not in keys(epp)  # not Ready
    await emulator.delete_object("Pod", "default", "engine-0")
    await eventually(lambda: keys(epp) == {"10.0.0.13:8000", "10.0.0.13:8001"}, timeout=30)

    # Watches idle past the client read timeout are re-opened and still deliver.
    await asyncio.sleep(READ_TIMEOUT + 1)
    await emulator.add_pod("default", "engine-3", {"app": "qwen-engine"}, ip="10.0.0.14")
    await eventually(lambda: "10.0.0.14:8000" in keys(epp), timeout=30)

    await emulator.create_object(
        {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
            "kind": "InferenceObjective",
            "metadata": {"name": "batch", "namespace": "default"},
            "spec": {"priority": -5, "poolRef": {"name": "qwen-pool"}},
        }
    )
    await emulator.create_object(
        {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
            "kind": "InferenceModelRewrite",
            "metadata": {"name": "alias", "namespace": "default"},
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
    )
    await eventually(lambda: epp.objectives.priority("batch") == -5, timeout=30)
    await eventually(lambda: epp.objectives.rewrite("qwen") == "qwen-v2", timeout=30)

    await emulator.delete_object("InferencePool", "default", "qwen-pool")
    await eventually(lambda: keys(epp) == set(), timeout=30)
    assert os.environ["KUBECONFIG"] == str(kubeconfig)


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
