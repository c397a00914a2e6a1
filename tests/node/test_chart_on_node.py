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
            # Slow steps: a streamed token every 125 ms, so the rollout tests' streams last
            # seconds with few chunks (the machine's CPU is the load's bound, not Envoy's).
            "--sim-base-ms=125",
        ],
        "ports": [{"name": "http", "containerPort": 8000}],
        # The chart sample's probes: a liveness probe from the engine's first second kills
        # it while torch still imports on a busy machine, and under the rollout tests'
        # streams a 1 s timeout failed both engines' probes (the kubelet restarted one, the
        # EPP dropped both: 503 "no ready endpoint").
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 2,
            "timeoutSeconds": 5,
            "failureThreshold": 5,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "initialDelaySeconds": 30,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        # 300m, not the sample's 100m: cgroup CPU shares follow requests, and on this
        # shared 2-core machine engines with 100m answered /health late even at 5 s.
        "resources": {"requests": {"cpu": "300m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}},
        "securityContext": restricted,
        "volumeMounts": mounts,
        # A deleted engine serves on while the EPP and the Service drop it (as any model
        # server behind a picker should: without, a request picked just before the EPP
        # saw the deletion meets a closed port).
        "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
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
    # The engines' own Service, as a user has one: its EndpointSlices are kube-proxy's and
    # the endpoint controller's view of the pool's pods.
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "sim-engine", "namespace": NS},
        "spec": {"selector": labels, "ports": [{"name": "http", "port": 8000}]},
    }
    return [deployment, service, pool, gateway, route]


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
        # cgroup CPU shares follow requests: at the chart's 100m the operator's view of a
        # pod change (and so the Gateways' EDS) lagged up to 10 s on this shared machine.
        "--set", "operator.resources.requests.cpu=300m",
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


STREAM_LOAD = ROOT / "tests" / "support" / "stream_load.py"
#: The rollout tests' load: 20 streamed completions a second, 16 tokens (about 2 s on the
#: simulated engines); every 10th asks for 120 (about 15 s: longer than the shutdown
#: manager's minimum drain, shorter than the grace period).
RATE, TOKENS, LONG_EVERY, LONG_TOKENS = 20, 16, 10, 120
GATEWAY_PROXY = "inference-gateway-infergate"  # proxy_name("inference-gateway")


class _StreamLoad:
    """tests/support/stream_load.py running in the node's namespace while a test acts."""

    def __init__(self, node: Node, url: str, long_every: int = LONG_EVERY) -> None:
        argv = [str(a) for a in (STREAM_LOAD, url, RATE, TOKENS, long_every, LONG_TOKENS)]
        self.process = node.popen(sys.executable, *argv)

    def stop(self) -> dict[str, Any]:
        """Stop starting requests; wait for those started; their outcomes."""
        out, err = self.process.communicate("stop\n", timeout=600)
        assert self.process.returncode == 0, err[-3000:]
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return result


def _pod_names(node: Node, prefix: str) -> set[str]:
    pods = json.loads(require_cluster(node).kubectl("get", "pods", "-n", NS, "-o", "json").stdout)
    return {
        p["metadata"]["name"] for p in pods["items"] if p["metadata"]["name"].startswith(prefix)
    }


def _roll(node: Node, deployment: str) -> tuple[set[str], set[str]]:
    """``kubectl rollout restart`` of ``deployment``; returns (old pods, new pods) once the
    rollout is done and every old pod is gone (drained and exited)."""
    cluster = require_cluster(node)
    old = _pod_names(node, deployment + "-")
    cluster.kubectl("rollout", "restart", "-n", NS, f"deployment/{deployment}")
    cluster.kubectl(
        "rollout", "status", "-n", NS, f"deployment/{deployment}", "--timeout=600s", timeout=620
    )
    for pod in old:
        _wait(node, "-n", NS, f"pod/{pod}", "--for=delete", timeout="600s")
    return old, _pod_names(node, deployment + "-")


def _assert_all_complete(result: dict[str, Any]) -> None:
    print("stream load:", json.dumps(result))  # the counts, shown with -rA
    started = result["started"]
    assert started > 0, result
    assert result["outcomes"] == {"complete": started}, result


def test_gateway_envoy_rolling_update_under_streaming_load_fails_no_request(
    node: Node, gateway_url: str
) -> None:
    """20 streamed completions a second through the Gateway's Service while its Envoy
    Deployment is rolled: the old proxy pod is drained by its shutdown manager before the
    kubelet stops it (listeners open while its endpoint is removed, every connection closed
    after its response), so every stream started, on either pod, completes."""
    load = _StreamLoad(node, gateway_url)
    try:
        time.sleep(3)  # streams in flight on the old pod when it is deleted
        old, new = _roll(node, GATEWAY_PROXY)
        time.sleep(2)  # and some on the new one only
    finally:
        result = load.stop()
    assert old and new and not old & new, (old, new)
    _assert_all_complete(result)


def test_epp_rolling_update_under_streaming_load_fails_no_request(
    node: Node, gateway_url: str
) -> None:
    """20 streamed completions a second while the pool's EPP Deployment is rolled (the
    operator's maxUnavailable 0, maxSurge 1): the new EPP is Ready before the old one is
    deleted; the old one serves on (preStop), DEGRADED in the Gateway's EDS while still
    Ready (used only until Envoy has health-checked the new one), then sends
    GOAWAY and lets its ext-proc streams finish. Every stream completes."""
    load = _StreamLoad(node, gateway_url)
    try:
        time.sleep(3)
        old, new = _roll(node, "sim-epp")
        time.sleep(2)
    finally:
        result = load.stop()
    assert old and new and not old & new, (old, new)
    _assert_all_complete(result)


def _slice_pods(node: Node, service: str) -> set[str]:
    """The pods the Service's EndpointSlices list (any condition)."""
    slices = json.loads(
        require_cluster(node).kubectl(
            "get", "endpointslices", "-n", NS, "-l", f"kubernetes.io/service-name={service}",
            "-o", "json",
        ).stdout
    )  # fmt: skip
    return {
        (endpoint.get("targetRef") or {}).get("name", "")
        for item in slices["items"]
        for endpoint in item.get("endpoints") or []
    }


def _epp_metrics(node: Node) -> str:
    service = require_cluster(node).get("service", "sim-epp", NS)
    assert service is not None
    code, body = node.http_get(f"http://{service['spec']['clusterIP']}:9090/metrics")
    assert code == 200, body[-500:]
    return body


def test_engine_pod_removed_is_dropped_by_its_service_slices_and_the_epp(
    node: Node, gateway_url: str
) -> None:
    """An engine pod deleted under 20 streamed completions a second: its Service's
    EndpointSlices and the EPP's endpoints drop it, its replacement joins both, and every
    stream completes."""
    cluster = require_cluster(node)
    _wait(node, "-n", NS, "deployment/sim-engine", "--for=condition=Available")
    victim = sorted(_pod_names(node, "sim-engine-"))[0]
    pod = cluster.get("pod", victim, NS)
    assert pod is not None
    address = f"{pod['status']['podIP']}:8000"
    assert victim in _slice_pods(node, "sim-engine")
    assert address in _epp_metrics(node)

    # Short streams only: an engine's own shutdown gives its streams 5 s (uvicorn's
    # graceful timeout), after the 5 s its preStop keeps it serving.
    load = _StreamLoad(node, gateway_url, long_every=0)
    try:
        time.sleep(3)
        cluster.kubectl("delete", "pod", "-n", NS, victim, "--wait=true", "--timeout=300s",
                        timeout=320)  # fmt: skip
        deadline = time.monotonic() + 120
        while victim in _slice_pods(node, "sim-engine") or address in _epp_metrics(node):
            assert time.monotonic() < deadline, "the deleted engine is still listed"
            time.sleep(1)
        _wait(node, "-n", NS, "deployment/sim-engine", "--for=condition=Available")
        time.sleep(2)
    finally:
        result = load.stop()
    _assert_all_complete(result)
    replacement = _pod_names(node, "sim-engine-") - {victim}
    assert len(replacement) == 2, replacement
    deadline = time.monotonic() + 60
    while not replacement <= _slice_pods(node, "sim-engine"):
        assert time.monotonic() < deadline, (replacement, _slice_pods(node, "sim-engine"))
        time.sleep(1)
