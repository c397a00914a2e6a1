"""Fixtures for the cluster tier: the chart installed on the real API server
(`installed`)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.controlplane import Cluster

ROOT = Path(__file__).resolve().parents[2]


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
