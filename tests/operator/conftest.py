"""Fixtures: the KMock-based API server (for the emulator's own tests); for the cluster
tier, the chart installed on the real API server (`installed`)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from infergate.operator.crd_validation import CRDRegistry
from infergate.testing.controlplane import Cluster
from infergate.testing.kube_emulator import KubeEmulator, serve_emulator, write_kubeconfig

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"


@pytest_asyncio.fixture
async def emulator() -> AsyncIterator[KubeEmulator]:
    async with serve_emulator([CRDS, CRDS / "kopf"]) as emu:
        yield emu


@pytest.fixture
def kubeconfig(emulator: KubeEmulator, tmp_path: Path) -> Path:
    return write_kubeconfig(tmp_path / "kubeconfig", str(emulator.url))


@pytest.fixture(scope="session")
def crd_registry() -> CRDRegistry:
    return CRDRegistry.from_paths(CRDS)


@pytest.fixture
def installed(cluster: Cluster) -> Iterator[tuple[str, Path]]:
    """The chart in a fresh namespace, watching only it; yields (namespace, SA kubeconfig)."""
    namespace = f"ig-op-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    cluster.helm(
        "install", "ig", str(ROOT / "charts" / "infergate"), "-n", namespace,
        "--set", f"operator.watchNamespaces={{{namespace}}}",
    )  # fmt: skip
    try:
        yield namespace, cluster.service_account_kubeconfig(namespace, "ig-infergate")
    finally:
        cluster.helm("uninstall", "ig", "-n", namespace, check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
