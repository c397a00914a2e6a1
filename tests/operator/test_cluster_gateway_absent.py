"""The operator on a cluster without the Gateway API: pools are served as before, the log
says why Gateways are not, and installing the Gateway API CRDs later starts the Gateway
controller without a restart (kopf notices new CRDs)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
import yaml

from infergate.procs import ProcessGroup, free_port, http_ready
from tests.support.controlplane import Cluster

from .test_cluster import wait_for

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
GATEWAY_API = ROOT / "crds" / "gateway-api"


def _gateway_api(cluster: Cluster, present: bool) -> None:
    if present:
        cluster.kubectl("apply", "--server-side", "-k", str(GATEWAY_API))
        for plural in ("gatewayclasses", "gateways", "httproutes", "referencegrants"):
            crd = f"crd/{plural}.gateway.networking.k8s.io"
            cluster.kubectl("wait", "--for=condition=Established", crd, "--timeout=60s")
    else:
        cluster.kubectl("delete", "--ignore-not-found", "--wait=true", "-k", str(GATEWAY_API))


def test_without_the_gateway_api_pools_work_and_gateways_start_when_it_arrives(
    cluster: Cluster, processes: ProcessGroup, infergate_cli: list[str]
) -> None:
    namespace = f"ig-nogw-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    cluster.helm(
        "install", "ig", str(ROOT / "charts" / "infergate"), "-n", namespace,
        "--set", f"operator.watchNamespaces={{{namespace}}}", "--set", "gatewayClass.create=false",
    )  # fmt: skip
    try:
        _gateway_api(cluster, present=False)
        kubeconfig = cluster.service_account_kubeconfig(namespace, "ig-infergate")
        health = free_port()
        operator = processes.start(
            "operator",
            [*infergate_cli, "operator", f"--namespace={namespace}", "--standalone",
             f"--liveness=http://127.0.0.1:{health}/healthz", f"--xds-port={free_port()}",
             "--xds-listen-address=127.0.0.1"],
            ready=http_ready(f"http://127.0.0.1:{health}/healthz"), timeout=120,
            env=dict(os.environ, KUBECONFIG=str(kubeconfig), INFERGATE_RESYNC_SECONDS="2"),
        )  # fmt: skip
        wait_for(
            lambda: (
                "the Gateway API (gateway.networking.k8s.io/v1) is not installed"
                in operator.log_tail(200_000)
            ),
            "the log line saying the Gateway API is absent",
        )
        pool = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())
        pool["metadata"]["namespace"] = namespace
        cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(pool))

        def pool_accepted() -> bool:
            body = cluster.get("inferencepool", "qwen-pool", namespace) or {}
            return any(
                cond["type"] == "Accepted" and cond["status"] == "True"
                for parent in (body.get("status") or {}).get("parents") or []
                for cond in parent.get("conditions") or []
            )

        wait_for(pool_accepted, "the pool Accepted without the Gateway API")

        # The Gateway API arrives: no restart needed.
        _gateway_api(cluster, present=True)
        gateway_class = f"late-{uuid.uuid4().hex[:5]}"
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps({
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass",
            "metadata": {"name": gateway_class},
            "spec": {"controllerName": "infergate.io/gateway-controller"},
        }))  # fmt: skip
        gateway = {
            "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
            "metadata": {"name": "late"},
            "spec": {"gatewayClassName": gateway_class,
                     "listeners": [{"name": "http", "port": 8080, "protocol": "HTTP"}]},
        }  # fmt: skip
        cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(gateway))

        def gateway_accepted() -> bool:
            body = cluster.get("gateway", "late", namespace) or {}
            conditions = (body.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Accepted" and c["status"] == "True" for c in conditions)

        wait_for(gateway_accepted, "the Gateway Accepted once the CRDs exist", timeout=120)
        assert cluster.get("deployment", "late-infergate", namespace) is not None
        assert operator.alive(), operator.log_tail()
        cluster.kubectl("delete", "gatewayclass", gateway_class, "--wait=false")
    finally:
        _gateway_api(cluster, present=True)  # the other tests of the session use them
        processes.stop_all()
        cluster.helm("uninstall", "ig", "-n", namespace, check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
