"""The operator flow against a real cluster (KUBECONFIG); skipped without one.

Needs cluster-admin for the CRDs. Runs the operator from this checkout as a local
process scoped to a fresh namespace, so nothing needs to be built or pushed.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from infergate.operator.kube import Kube, KubeError
from infergate.procs import ProcessGroup, free_port, http_ready

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]


def wait(probe: Callable[[], Any], timeout: float = 120.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def kube() -> Kube:
    return Kube()


@pytest.fixture
def namespace(kube: Kube) -> Iterator[str]:
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        if doc.get("kind") == "CustomResourceDefinition":
            kube.call(
                "PATCH", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{doc['metadata']['name']}",
                query=[("fieldManager", "infergate-tests"), ("force", "true")],
                body=doc, content_type="application/apply-patch+yaml",
            )  # fmt: skip
    name = f"infergate-test-{uuid.uuid4().hex[:6]}"
    kube.call(
        "POST",
        "/api/v1/namespaces",
        body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
    )
    try:
        yield name
    finally:
        with contextlib.suppress(KubeError):
            kube.call("DELETE", f"/api/v1/namespaces/{name}")


def test_operator_on_a_real_cluster(
    kube: Kube, namespace: str, processes: ProcessGroup, infergate_cli: list[str]
) -> None:
    port = free_port()
    processes.start(
        "operator",
        [*infergate_cli, "operator", "--standalone", f"--namespace={namespace}",
         f"--liveness=http://127.0.0.1:{port}/healthz"],
        ready=http_ready(f"http://127.0.0.1:{port}/healthz"), timeout=120, env=dict(os.environ),
    )  # fmt: skip
    pool = copy.deepcopy(
        yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())
    )
    pool["metadata"]["namespace"] = namespace
    kube.apply(pool)

    deployment = wait(
        lambda: kube.get("Deployment", namespace, "qwen-pool-epp"), what="EPP Deployment"
    )
    assert deployment["metadata"]["ownerReferences"][0]["kind"] == "InferencePool"

    def accepted() -> bool:
        body = kube.get("InferencePool", namespace, "qwen-pool") or {}
        for parent in (body.get("status") or {}).get("parents") or []:
            conds = {c["type"]: c["status"] for c in parent.get("conditions") or []}
            if conds.get("Accepted") == "True" and conds.get("ResolvedRefs") == "True":
                return True
        return False

    wait(accepted, what="Accepted and ResolvedRefs")
    kube.delete("InferencePool", namespace, "qwen-pool")
    wait(
        lambda: kube.get("Deployment", namespace, "qwen-pool-epp") is None,
        what="garbage collection",
    )
