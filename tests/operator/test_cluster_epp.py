"""The EPP in pool mode on a real API server, with its own ServiceAccount token.

The operator (chart's token) deploys a standalone-Envoy EPP for a pool; kwok runs the EPP
pod and two engine pods with loopback (127.X.Y.Z) IPs, and the harness (``tests.support.pods``)
backs each with the real process its container describes, bound to the pod's IP: the
simulated engine, the EPP (whose only credential is a TokenRequest token for the
ServiceAccount the operator made for it) and the real Envoy with the operator's
bootstrap. Requests go client -> Envoy -> EPP -> engine; the EPP follows pods through
its watches as they go away or turn NotReady.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import pytest

from infergate.operator.constants import ENVOY_ADMIN_PORT
from infergate.procs import ProcessGroup, http_ready, tcp_ready
from tests.support.controlplane import Cluster
from tests.support.pods import materialize_volumes, pod_argv, pod_env

from .test_cluster import run_operator, wait_for

pytestmark = pytest.mark.cluster

ENGINE = "qwen-engine"


def _engine_deployment(namespace: str, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": ENGINE, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": ENGINE}},
            "template": {
                "metadata": {"labels": {"app": ENGINE}},
                "spec": {
                    "containers": [
                        {
                            "name": "engine",
                            "image": "registry.example/infergate-engine:test",
                            "args": [
                                "engine",
                                "serve",
                                "/models/tiny",
                                "--simulate",
                                "--host=0.0.0.0",
                                "--port=8000",
                                "--served-model-name=tiny",
                            ],
                            "ports": [{"containerPort": 8000}],
                            "volumeMounts": [{"name": "models", "mountPath": "/models"}],
                        }
                    ],
                    "volumes": [{"name": "models", "emptyDir": {}}],
                },
            },
        },
    }


def _pods(cluster: Cluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json")
    pods: list[dict[str, Any]] = json.loads(out.stdout)["items"]
    return [
        p for p in pods if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")
    ]


def _health(target: str, service: str) -> str:
    """``grpc.health.v1`` Check of ``service`` at ``target``: the status name or the error."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
        except grpc.RpcError as error:
            return str(error.code())
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def _ready_pods(metrics_url: str) -> float | None:
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    match = re.search(r'^inference_pool_ready_pods\{name="qwen-pool"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else None


def _envoy_pool_hosts(admin: str) -> int | None:
    """How many hosts the sidecar Envoy's pool cluster has: what the EPP sent over EDS."""
    from infergate.envoy.bootstrap import POOL_CLUSTER
    from tests.support.probes import envoy_cluster_hosts

    try:
        return len(envoy_cluster_hosts(admin, POOL_CLUSTER))
    except httpx.HTTPError:
        return None


def test_epp_discovers_pods_and_routes_through_envoy(
    cluster: Cluster,
    installed: tuple[str, Path],
    processes: ProcessGroup,
    infergate_cli: list[str],
    envoy_binary: Path,
    tmp_path: Path,
) -> None:
    from infergate.stack.local import ensure_tiny_model

    namespace, operator_kubeconfig = installed
    model = ensure_tiny_model()
    run_operator(processes, infergate_cli, operator_kubeconfig, namespace, "operator")
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(_engine_deployment(namespace, 2)))
    pool = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {
            "name": "qwen-pool",
            "namespace": namespace,
            "annotations": {"infergate.io/standalone-envoy": "true"},
        },
        "spec": {
            "selector": {"matchLabels": {"app": ENGINE}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "qwen-pool-epp", "port": {"number": 9002}},
        },
    }
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(pool))

    # The engine pods, each backed by a simulated engine on its pod IP.
    engines = wait_for(
        lambda: (p := _pods(cluster, namespace, f"app={ENGINE}")) and len(p) == 2 and p,
        "two engine pods with IPs",
    )
    for pod in engines:
        (container,) = pod["spec"]["containers"]
        argv = pod_argv(pod, container, infergate_cli, {"/models/tiny": model})
        ip = pod["status"]["podIP"]
        processes.start(
            pod["metadata"]["name"], argv, ready=http_ready(f"http://{ip}:8000/health"),
            timeout=180,
        )  # fmt: skip

    # The EPP pod the operator's Deployment made: the EPP and Envoy containers, for real.
    (epp_pod,) = wait_for(
        lambda: _pods(cluster, namespace, "infergate.io/pool=qwen-pool"), "the EPP pod"
    )
    ip = epp_pod["status"]["podIP"]
    assert epp_pod["spec"]["serviceAccountName"] == "qwen-pool-epp"
    env = pod_env(cluster, epp_pod)  # the EPP's own ServiceAccount, via TokenRequest
    containers = {c["name"]: c for c in epp_pod["spec"]["containers"]}
    epp, envoy = containers["epp"], containers["envoy"]
    mounts = materialize_volumes(cluster, epp_pod, epp, tmp_path)
    processes.start(
        "epp", pod_argv(epp_pod, epp, infergate_cli, mounts), env=env,
        ready=tcp_ready(ip, 9003), timeout=120,
    )  # fmt: skip
    envoy_mounts = materialize_volumes(cluster, epp_pod, envoy, tmp_path)
    envoy_argv = pod_argv(epp_pod, envoy, [str(envoy_binary)], envoy_mounts)
    if "--base-id" in envoy_argv:  # several Envoys share this machine: no hot restart
        at = envoy_argv.index("--base-id")
        del envoy_argv[at : at + 2]
    processes.start(
        "envoy", [*envoy_argv, "--disable-hot-restart"], ready=tcp_ready(ip, 8081), timeout=60
    )

    metrics = f"http://{ip}:9090/metrics"
    wait_for(lambda: _ready_pods(metrics) == 2, "the EPP to see both engine pods")
    # Envoy learns them from the EPP over EDS, on its own schedule, and opens its listener
    # without the pool once its 5 s initial fetch timeout passes; requests before the
    # endpoints arrive get "no healthy upstream" (CI saw it). Why EDS can take that long
    # is open: issue 25's note.
    admin = f"http://{ip}:{ENVOY_ADMIN_PORT}"  # the pod's loopback is its own IP here
    wait_for(lambda: _envoy_pool_hosts(admin) == 2, "Envoy to learn both pods over EDS")
    # The gRPC health services its probes name answer what the probes expect.
    liveness = epp["livenessProbe"]["grpc"]
    readiness = epp["readinessProbe"]["grpc"]
    assert _health(f"{ip}:{liveness['port']}", liveness["service"]) == "SERVING"
    wait_for(
        lambda: _health(f"{ip}:{readiness['port']}", readiness["service"]) == "SERVING",
        "the EPP's readiness",
    )
    with httpx.Client(base_url=f"http://{ip}:8081", timeout=60) as client:
        for _ in range(6):
            response = client.post(
                "/v1/completions", json={"model": "tiny", "prompt": "Hello there", "max_tokens": 2}
            )
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 2

        # A pod goes away (scale down): the EPP's watch drops it; requests still succeed.
        cluster.kubectl("scale", "deployment", ENGINE, "-n", namespace, "--replicas=1")
        wait_for(lambda: _ready_pods(metrics) == 1, "the EPP to drop the deleted pod")
        (left,) = wait_for(
            lambda: (p := _pods(cluster, namespace, f"app={ENGINE}")) and len(p) == 1 and p,
            "one engine pod left",
        )
        response = client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "Hello again", "max_tokens": 2}
        )
        assert response.status_code == 200, response.text

        # The last pod turns NotReady (what a failing readiness probe makes the kubelet
        # write; the admin writes it here): the EPP has nothing to pick, so 503.
        status = {
            "status": {
                "conditions": [
                    {"type": "Ready", "status": "False", "reason": "ReadinessProbeFailed"},
                    {"type": "ContainersReady", "status": "False"},
                ]
            }
        }
        cluster.kubectl(
            "patch", "pod", left["metadata"]["name"], "-n", namespace, "--subresource=status",
            "--type=strategic", "-p", json.dumps(status),
        )  # fmt: skip
        wait_for(lambda: _ready_pods(metrics) == 0, "the EPP to drop the NotReady pod")
        assert _health(f"{ip}:{readiness['port']}", readiness["service"]) == "NOT_SERVING"
        response = client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2}
        )
        assert response.status_code == 503, response.text
