"""The project's own images (``make images``' OCI layouts) as pods on the real node.

Each image is imported into the node's containerd under the chart's repository and run
with ``imagePullPolicy: Never`` as the operator's and the chart's manifests run it: their
probes (the kubelet's own gRPC and HTTP probes), the restricted securityContext (uid 65532,
read-only root filesystem, no capabilities), an emptyDir ``/tmp`` and a memory limit. A
Service in front of each is reached through kube-proxy from the node's namespace.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from infergate.operator import constants as c
from tests.support.controlplane import Cluster
from tests.support.node import Node, require_cluster

pytestmark = pytest.mark.node

RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}


def _pod(name: str, container: dict[str, Any], ports: list[int]) -> str:
    """A Pod (uid 65532 like the chart's, emptyDir /tmp) and a ClusterIP Service on ``ports``."""
    container = {
        "name": name,
        "imagePullPolicy": "Never",
        "securityContext": RESTRICTED,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        **container,
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {"app": name}},
        "spec": {
            "securityContext": {"runAsUser": 65532, "runAsGroup": 65532},
            "containers": [container],
            "volumes": [{"name": "tmp", "emptyDir": {}}],
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "selector": {"app": name},
            "ports": [{"name": f"p{port}", "port": port, "targetPort": port} for port in ports],
        },
    }
    return yaml.safe_dump_all([pod, service])


def _ready(cluster: Cluster, name: str, timeout: str = "300s") -> dict[str, Any]:
    """Wait for the kubelet to report the pod Ready; its status, with a clear failure."""
    waited = cluster.kubectl(
        "wait", f"pod/{name}", "--for=condition=Ready", f"--timeout={timeout}", check=False
    )
    pod = cluster.get("pod", name, "default")
    assert pod is not None
    assert waited.returncode == 0, json.dumps(pod.get("status"), indent=1)
    status: dict[str, Any] = pod["status"]
    return status


def _get_via_service(node: Node, url: str) -> tuple[int, str]:
    """GET through a ClusterIP, waiting out kube-proxy's first sync of the Service."""
    deadline = time.monotonic() + 60
    answer = node.http_get(url)
    while answer[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
        answer = node.http_get(url)
    return answer


def test_epp_image_runs_as_a_pod_with_the_operators_probes(
    node: Node, node_image: Callable[[str], str]
) -> None:
    """The EPP image, with a static endpoint (no pool: the pod needs no API access), is
    made Ready by the kubelet's gRPC readiness probe on the operator's health port and
    serves metrics through its Service."""
    cluster = require_cluster(node)
    image = node_image("epp")
    args = [
        "epp", "--endpoint", f"{node.env['NODE_IP']}:8000",
        "--grpc-port", str(c.EPP_GRPC_PORT), "--grpc-health-port", str(c.EPP_HEALTH_PORT),
        "--metrics-port", str(c.EPP_METRICS_PORT),
    ]  # fmt: skip
    health = c.EPP_HEALTH_PORT
    container = {
        "image": image,
        "args": args,
        "readinessProbe": {"grpc": {"port": health, "service": "readiness"}, "periodSeconds": 2},
        "livenessProbe": {"grpc": {"port": health, "service": "liveness"}, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "100m"}, "limits": {"memory": "1Gi"}},
    }
    cluster.kubectl("apply", "-f", "-", stdin=_pod("epp", container, [c.EPP_METRICS_PORT]))
    status = _ready(cluster, "epp")
    container_status = status["containerStatuses"][0]
    assert container_status["imageID"], container_status
    assert container_status["restartCount"] == 0

    service = cluster.get("service", "epp", "default")
    assert service is not None
    code, body = _get_via_service(
        node, f"http://{service['spec']['clusterIP']}:{c.EPP_METRICS_PORT}/metrics"
    )
    assert code == 200
    assert "# TYPE" in body
    cluster.kubectl("delete", "pod/epp", "service/epp", "--wait=true", "--timeout=90s")
