"""The node runs pods for real: a pod from a local image is pulled from containerd's store,
made Ready by the kubelet's readiness probe, and answers through kube-proxy's ClusterIP.

The image is the probe's (``tools/node/probe.sh`` builds it with buildah from Debian's
static busybox: ``httpd`` on 8080 as uid 65532) and ``up`` imports it into containerd.
"""

from __future__ import annotations

import time

import pytest
import yaml

from tests.support.node import Node, require_cluster

pytestmark = pytest.mark.node

PAGE = "infergate node probe: served by a pod"


def _manifest(image: str) -> str:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "httpd", "namespace": "default", "labels": {"app": "httpd"}},
        "spec": {
            "containers": [
                {
                    "name": "httpd",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "ports": [{"containerPort": 8080}],
                    "readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1},
                    "securityContext": {
                        "runAsNonRoot": True,
                        "readOnlyRootFilesystem": True,
                        "allowPrivilegeEscalation": False,
                    },
                }
            ]
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "httpd", "namespace": "default"},
        "spec": {"selector": {"app": "httpd"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    return yaml.safe_dump_all([pod, service])


def test_pod_from_a_local_image_is_ready_and_answers_through_its_cluster_ip(node: Node) -> None:
    cluster = require_cluster(node)
    cluster.kubectl("apply", "-f", "-", stdin=_manifest(node.env["PROBE_IMAGE"]))
    cluster.kubectl("wait", "pod/httpd", "--for=condition=Ready", "--timeout=180s")
    pod = cluster.get("pod", "httpd", "default")
    assert pod is not None
    status = pod["status"]["containerStatuses"][0]
    assert status["containerID"].startswith("containerd://")
    assert status["ready"] is True
    ip = cluster.get("service", "httpd", "default")
    assert ip is not None
    cluster_ip = ip["spec"]["clusterIP"]

    deadline = time.monotonic() + 60
    answer = node.http_get(f"http://{cluster_ip}/")
    while answer[0] != 200 and time.monotonic() < deadline:  # kube-proxy's rules lag
        time.sleep(0.5)
        answer = node.http_get(f"http://{cluster_ip}/")
    assert answer == (200, PAGE + "\n")
    cluster.kubectl("delete", "pod/httpd", "service/httpd", "--wait=true", "--timeout=60s")
