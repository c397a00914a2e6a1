"""``helm install`` of the chart on the real node, as a user would, with the project's images.

The chart's operator (its pod, probes, ServiceAccount token, in-cluster API access through
the ``kubernetes`` Service), an InferencePool of simulated engines (the engine image,
``engine serve --simulate``), the EPP the operator deploys for the pool, and a Gateway of
the chart's class: the operator's Gateway controller makes its Envoy Deployment, which
dials the operator's xDS Service by name (cluster DNS). Requests go to the Gateway's
Service from the node's namespace, through kube-proxy, Envoy, the EPP and the engines.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from tests.support.node import ROOT, Node, require_cluster

# Importing the engine image (2.8 GB compressed) and starting its pods takes minutes: the
# first test to use ``gateway_url`` pays for it.
pytestmark = [pytest.mark.node, pytest.mark.timeout(1200)]

NS = "llm"
REQUESTS = 200
#: Sends N completions to URL from inside the node's namespace; prints {status: count}.
_LOAD = """
import collections, json, sys, urllib.error, urllib.request
url, n = sys.argv[1], int(sys.argv[2])
body = json.dumps({"model": "tiny", "prompt": "Hello from the node", "max_tokens": 4}).encode()
counts = collections.Counter()
for i in range(n):
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            reply.read()
            counts[reply.status] += 1
    except urllib.error.HTTPError as error:
        counts[error.code] += 1
    except OSError as error:
        counts[type(error).__name__] += 1
print(json.dumps(counts))
"""


def _engine_image(node_image: Callable[[str], str]) -> str:
    """The CPU engine image if built, else the CUDA one (its torch runs on CPU too)."""
    if (ROOT / "build" / "images" / "engine" / "oci-layout").is_file():
        return node_image("engine")
    return node_image("engine-cuda")


def _workload(engine_image: str) -> list[dict[str, Any]]:
    """Two simulated engines (the chart sample's pod, ``--simulate``), their pool, a Gateway
    of the chart's class and an HTTPRoute to the pool."""
    labels = {"app": "sim-engine"}
    restricted = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    mounts = [{"name": "models", "mountPath": "/models"}, {"name": "tmp", "mountPath": "/tmp"}]
    engine = {
        "name": "engine",
        "image": engine_image,
        "args": [
            "engine",
            "serve",
            "/models/tiny",
            "--simulate",
            "--host=0.0.0.0",
            "--port=8000",
            "--served-model-name=tiny",
        ],
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 2},
        # The chart sample's probes: a liveness probe from the engine's first second kills
        # it while torch still imports on a busy machine.
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "initialDelaySeconds": 30,
            "periodSeconds": 10,
        },
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}},
        "securityContext": restricted,
        "volumeMounts": mounts,
    }
    make_model = {
        "name": "make-tiny-model",
        "image": engine_image,
        "args": ["engine", "make-tiny-model", "/models/tiny", "--arch", "llama"],
        "securityContext": restricted,
        "volumeMounts": mounts,
    }
    pod_spec = {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "runAsGroup": 65532,
            "fsGroup": 65532,
        },
        "initContainers": [make_model],
        "containers": [engine],
        "volumes": [{"name": "models", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "sim-engine", "namespace": NS},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }
    pool = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "sim", "namespace": NS},
        "spec": {
            "selector": {"matchLabels": labels},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "sim-epp", "port": {"number": 9002}},
        },
    }
    gateway = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "metadata": {"name": "inference-gateway", "namespace": NS},
        "spec": {
            "gatewayClassName": "infergate",
            "listeners": [{"name": "http", "protocol": "HTTP", "port": 80}],
        },
    }
    route = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "llm-route", "namespace": NS},
        "spec": {
            "parentRefs": [{"name": "inference-gateway"}],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                    "backendRefs": [
                        {
                            "group": "inference.networking.k8s.io",
                            "kind": "InferencePool",
                            "name": "sim",
                        }
                    ],
                }
            ],
        },
    }
    return [deployment, pool, gateway, route]


def _wait(node: Node, *args: str, timeout: str = "300s") -> None:
    """``kubectl wait`` that fails with the pods, events and container logs in the message."""
    cluster = require_cluster(node)
    result = cluster.kubectl("wait", *args, f"--timeout={timeout}", check=False)
    if result.returncode != 0:
        pods = cluster.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
        events = cluster.kubectl("get", "events", "-A", check=False).stdout[-4000:]
        logs = node.container_logs(NS) + node.container_logs("infergate-system")
        pytest.fail(f"kubectl wait {' '.join(args)}: {result.stderr}\n{pods}\n{events}\n{logs}")


def _install(node: Node) -> None:
    """The chart as a user installs it: the operator and its GatewayClass; the Envoy image is
    the node's (no registry), the Gateway's Service a ClusterIP (no load balancer here)."""
    require_cluster(node).helm(
        "install", "infergate", str(ROOT / "charts" / "infergate"),
        "--namespace", "infergate-system", "--create-namespace",
        "--set", f"epp.envoyImage={node.env['ENVOY_IMAGE']}",
        "--set", "gateway.serviceType=ClusterIP",
        "--wait", "--timeout", "300s", timeout=400,
    )  # fmt: skip
    _wait(node, "-n", "infergate-system", "deployment/infergate", "--for=condition=Available")


def _send(node: Node, url: str, n: int) -> dict[str, int]:
    result = node.run(sys.executable, "-c", _LOAD, url, str(n), timeout=600)
    counts: dict[str, int] = json.loads(result.stdout.strip().splitlines()[-1])
    return counts


@pytest.fixture(scope="module")
def gateway_url(node: Node, node_image: Callable[[str], str]) -> str:
    """The chart installed, the engines, pool, Gateway and route applied and ready: the
    Gateway's completions URL (its Service's ClusterIP)."""
    cluster = require_cluster(node)
    node_image("operator")
    node_image("epp")
    engine = _engine_image(node_image)
    _install(node)

    cluster.kubectl("create", "namespace", NS)
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(_workload(engine)))
    _wait(node, "-n", NS, "deployment/sim-engine", "--for=condition=Available", timeout="600s")
    deadline = time.monotonic() + 120
    while cluster.get("deployment", "sim-epp", NS) is None and time.monotonic() < deadline:
        time.sleep(1)  # the operator reconciles the pool into its EPP
    _wait(node, "-n", NS, "deployment/sim-epp", "--for=condition=Available")
    _wait(node, "-n", NS, "gateway/inference-gateway", "--for=condition=Programmed")
    gateway = cluster.get("gateway", "inference-gateway", NS)
    assert gateway is not None
    url = f"http://{gateway['status']['addresses'][0]['value']}/v1/completions"
    deadline = time.monotonic() + 120
    while node.http_get(url)[0] not in (200, 405) and time.monotonic() < deadline:
        time.sleep(1)  # Envoy takes its routes over xDS after the Deployment is Available
    return url


def test_helm_install_routes_requests_through_the_gateway_to_simulated_engines(
    node: Node, gateway_url: str
) -> None:
    counts = _send(node, gateway_url, REQUESTS)
    assert counts == {"200": REQUESTS}


def _epp_container(node: Node) -> dict[str, Any]:
    """The pool's EPP pod's container status (one replica)."""
    pods = json.loads(require_cluster(node).kubectl("get", "pods", "-n", NS, "-o", "json").stdout)
    epp = [p for p in pods["items"] if p["metadata"]["name"].startswith("sim-epp-")]
    assert len(epp) == 1, [p["metadata"]["name"] for p in epp]
    status: dict[str, Any] = epp[0]["status"]["containerStatuses"][0]
    return status


def test_epp_killed_is_restarted_by_the_kubelet_fail_close_holds_and_routing_resumes(
    node: Node, gateway_url: str
) -> None:
    """SIGKILL the EPP's process: the kubelet restarts its container; while it is down the
    pool (FailClose, its default) answers 5xx through the Gateway, never a request routed
    past the picker; once the EPP is Ready again, routing resumes: every request answers
    200."""
    before = _epp_container(node)
    container_id = before["containerID"].removeprefix("containerd://")
    os.kill(node.container_pid(container_id), signal.SIGKILL)

    during: Counter[str] = Counter()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        during.update(_send(node, gateway_url, 5))
        now = _epp_container(node)
        if now["restartCount"] > before["restartCount"] and now["ready"]:
            break
    else:
        pytest.fail(f"EPP not restarted and Ready in 300 s: {_epp_container(node)}")
    assert during["200"] < sum(during.values()), during  # the first requests found no EPP
    assert all(code == "200" or code.startswith("5") for code in during), during
    # Ready is the kubelet's view; the Gateway's Envoy finds the EPP again on its own
    # schedule (its ext-proc cluster's ejection and reconnects).
    deadline = time.monotonic() + 120
    while _send(node, gateway_url, 1) != {"200": 1}:
        assert time.monotonic() < deadline, "routing did not resume 120 s after the EPP was Ready"
        time.sleep(0.5)
    assert _send(node, gateway_url, 50) == {"200": 50}
