"""The operator against a real API server, with the chart's ServiceAccount token.

The chart is installed with the real ``helm`` (scoped to one namespace), then the operator
runs from this checkout as a local process whose only credential is a TokenRequest token
for the chart's ServiceAccount: the chart's RBAC is exactly what the API server enforces.
The real garbage collector removes what the pool owned when the pool goes.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from infergate.procs import ManagedProcess, ProcessGroup, free_port, http_ready
from tests.support.controlplane import Cluster, audit_writes

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
RELEASE = "ig"
SA = f"{RELEASE}-infergate"
OWNED = ("deployment", "service", "configmap", "serviceaccount", "role", "rolebinding")


def wait_for(probe: Callable[[], Any], what: str, timeout: float = 90.0) -> Any:
    """Poll ``probe`` until truthy; the deadline only bounds a hang."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def run_operator(
    processes: ProcessGroup, cli: list[str], kubeconfig: Path, namespace: str, name: str
) -> ManagedProcess:
    port = free_port()
    env = dict(
        os.environ,
        KUBECONFIG=str(kubeconfig),
        INFERGATE_RESYNC_SECONDS="2",
        INFERGATE_EPP_IMAGE="registry.example/infergate-epp:test",
    )
    return processes.start(
        name,
        [*cli, "operator", f"--namespace={namespace}", "--peering=infergate",
         f"--liveness=http://127.0.0.1:{port}/healthz", f"--xds-port={free_port()}"],
        ready=http_ready(f"http://127.0.0.1:{port}/healthz"), timeout=120, env=env,
    )  # fmt: skip


def _gone(cluster: Cluster, kind: str, name: str, namespace: str) -> bool:
    return cluster.get(kind, name, namespace) is None


def _conditions(cluster: Cluster, namespace: str) -> dict[str, str]:
    pool = cluster.get("inferencepool", "qwen-pool", namespace) or {}
    for parent in (pool.get("status") or {}).get("parents") or []:
        return {c["type"]: c["status"] for c in parent.get("conditions") or []}
    return {}


def test_operator_reconciles_a_pool_with_the_charts_rbac(
    cluster: Cluster,
    installed: tuple[str, Path],
    processes: ProcessGroup,
    infergate_cli: list[str],
) -> None:
    namespace, sa_kubeconfig = installed
    # Two replicas with kopf peering: one reconciles, the other stands by; no fight.
    run_operator(processes, infergate_cli, sa_kubeconfig, namespace, "operator-a")
    run_operator(processes, infergate_cli, sa_kubeconfig, namespace, "operator-b")

    pool = copy.deepcopy(
        yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())
    )
    pool["metadata"]["namespace"] = namespace
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(pool))

    for kind in OWNED:
        obj = wait_for(
            functools.partial(cluster.get, kind, "qwen-pool-epp", namespace), f"the EPP {kind}"
        )
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner["kind"] == "InferencePool" and owner["name"] == "qwen-pool"
    wait_for(
        lambda: (
            _conditions(cluster, namespace).get("Accepted") == "True"
            and _conditions(cluster, namespace).get("ResolvedRefs") == "True"
        ),
        "Accepted and ResolvedRefs",
    )
    # The EPP Deployment's pods are made by the real controllers and run under kwok.
    wait_for(
        lambda: (cluster.get("deployment", "qwen-pool-epp", namespace) or {})
        .get("status", {}).get("readyReplicas"),
        "the EPP Deployment's pod to be Ready",
    )  # fmt: skip

    # Peering: exactly one replica did the work, the other stood by.
    def reconciled(process: ManagedProcess) -> bool:
        log = process.log_path.read_text() if process.log_path is not None else ""
        return '"message": "reconciled ' in log

    operators = [p for p in processes if p.name.startswith("operator-")]
    active = [p for p in operators if reconciled(p)]
    assert len(active) == 1, [p.name for p in active]
    (standby,) = [p for p in operators if p is not active[0]]

    # The active replica goes (a clean exit leaves the peering at once): the standby takes
    # over, and a change to the pool is patched into what it owns.
    active[0].stop()
    cluster.kubectl(
        "annotate", "inferencepool", "qwen-pool", "-n", namespace,
        "infergate.io/epp-replicas=2",
    )  # fmt: skip
    wait_for(
        lambda: (cluster.get("deployment", "qwen-pool-epp", namespace) or {})
        .get("spec", {}).get("replicas") == 2,
        "the standby to scale the EPP Deployment to 2",
    )  # fmt: skip
    wait_for(lambda: reconciled(standby), "the standby's log of its reconcile")

    # Deleting the pool: the real garbage collector removes everything it owned.
    cluster.kubectl("delete", "inferencepool", "qwen-pool", "-n", namespace)
    for kind in OWNED:
        wait_for(
            functools.partial(_gone, cluster, kind, "qwen-pool-epp", namespace),
            f"garbage collection of the {kind}",
        )
    assert standby.alive(), f"{standby.name} exited:\n{standby.log_tail()}"


def test_what_the_operator_may_not_do_is_refused(
    cluster: Cluster, installed: tuple[str, Path]
) -> None:
    namespace, sa_kubeconfig = installed
    # What it needs, in its namespace.
    assert cluster.can_i(sa_kubeconfig, "patch", "deployments", "-n", namespace)
    assert cluster.can_i(sa_kubeconfig, "list", "pods", "-n", namespace)
    # Never Secrets, never Pods, never another namespace, never anything cluster-wide.
    assert not cluster.can_i(sa_kubeconfig, "get", "secrets", "-n", namespace)
    assert not cluster.can_i(sa_kubeconfig, "create", "pods", "-n", namespace)
    assert not cluster.can_i(sa_kubeconfig, "create", "deployments", "-n", "default")
    assert not cluster.can_i(sa_kubeconfig, "list", "inferencepools", "-A")
    assert not cluster.can_i(sa_kubeconfig, "create", "clusterrolebindings")
    # And the API server refuses the calls themselves, not just the review.
    result = cluster.kubectl("get", "secrets", "-n", namespace, kubeconfig=sa_kubeconfig,
                             check=False)  # fmt: skip
    assert result.returncode != 0 and "Forbidden" in result.stderr
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "escape", "namespace": "default"},
        "spec": {
            "selector": {"matchLabels": {"app": "escape"}},
            "template": {
                "metadata": {"labels": {"app": "escape"}},
                "spec": {"containers": [{"name": "c", "image": "registry.example/x"}]},
            },
        },
    }
    result = cluster.kubectl("apply", "-f", "-", kubeconfig=sa_kubeconfig, check=False,
                             stdin=json.dumps(deployment))  # fmt: skip
    assert result.returncode != 0 and "Forbidden" in result.stderr
    # RBAC escalation prevention: it cannot grant itself more than it holds.
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "escalate", "namespace": namespace},
        "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}],
    }
    result = cluster.kubectl("apply", "-f", "-", kubeconfig=sa_kubeconfig, check=False,
                             stdin=json.dumps(role))  # fmt: skip
    assert result.returncode != 0 and "forbidden" in result.stderr.lower()


def test_resync_and_restart_write_nothing_new(
    cluster: Cluster,
    installed: tuple[str, Path],
    processes: ProcessGroup,
    infergate_cli: list[str],
) -> None:
    """Once a pool has settled, resyncs and a restarted operator leave the real API
    server's state alone: its audit log shows no write from the operator's account
    (kopf's own peering heartbeats aside)."""
    if cluster.audit_log is None:
        pytest.skip("needs the local control plane's audit log")
    namespace, sa_kubeconfig = installed
    user = f"system:serviceaccount:{namespace}:ig-infergate"
    operator = run_operator(processes, infergate_cli, sa_kubeconfig, namespace, "operator")
    pool = copy.deepcopy(
        yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())
    )
    pool["metadata"]["namespace"] = namespace
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(pool))
    wait_for(
        lambda: _conditions(cluster, namespace).get("Accepted") == "True"
        and (cluster.get("deployment", "qwen-pool-epp", namespace) or {})
        .get("status", {}).get("availableReplicas"),
        "the pool to be accepted and its EPP available",
    )  # fmt: skip

    def operator_writes() -> list[str]:
        assert cluster.audit_log is not None
        return [w for w in audit_writes(cluster.audit_log, user) if "kopfpeerings" not in w]

    # Settled: the writes stop (the EPP's availability lands in the status once).
    def settled() -> list[str] | None:
        before = operator_writes()
        time.sleep(5)  # more than two resyncs (INFERGATE_RESYNC_SECONDS=2)
        return before if operator_writes() == before else None

    baseline = wait_for(settled, "the operator to stop writing", timeout=120)
    assert any(w.startswith("patch ") and "/deployments/" in w for w in baseline)

    # Steady state: more resyncs, not one write.
    time.sleep(5)
    assert operator_writes()[len(baseline) :] == []

    # Restart: the new process lists everything, compares, and writes nothing.
    operator.stop()
    run_operator(processes, infergate_cli, sa_kubeconfig, namespace, "operator-restarted")
    time.sleep(5)
    assert operator_writes()[len(baseline) :] == []


def test_objectives_and_rewrites_follow_their_pool(
    cluster: Cluster,
    installed: tuple[str, Path],
    processes: ProcessGroup,
    infergate_cli: list[str],
) -> None:
    """The policy objects' status says whether the pool they name exists, through the
    operator's kopf indexes, written with the chart's rights on the real API server."""
    namespace, sa_kubeconfig = installed
    run_operator(processes, infergate_cli, sa_kubeconfig, namespace, "operator")
    for path in ("inferenceobjective.yaml", "inferencemodelrewrite.yaml"):
        body = yaml.safe_load((ROOT / "crds/examples/valid" / path).read_text())
        body["metadata"]["namespace"] = namespace
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(body))

    def condition(kind: str, name: str, type_: str) -> str | None:
        obj = cluster.get(kind, name, namespace) or {}
        for cond in (obj.get("status") or {}).get("conditions") or []:
            if cond["type"] == type_:
                return f"{cond['status']}/{cond['reason']}"
        return None

    objective = ("inferenceobjective", "batch-jobs", "Ready")
    rewrite = ("inferencemodelrewrite", "canary", "Accepted")
    wait_for(lambda: condition(*objective) == "False/PoolNotFound", "objective PoolNotFound")
    wait_for(lambda: condition(*rewrite) == "False/PoolNotFound", "rewrite PoolNotFound")
    pool = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())
    pool["metadata"]["namespace"] = namespace
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(pool))
    wait_for(lambda: condition(*objective) == "True/Ready", "objective Ready")
    wait_for(lambda: condition(*rewrite) == "True/Accepted", "rewrite Accepted")
    cluster.kubectl("delete", "inferencepool", "qwen-pool", "-n", namespace)
    wait_for(lambda: condition(*objective) == "False/PoolNotFound", "objective PoolNotFound again")


def test_invalid_pools_get_a_false_condition_and_a_warning_event(
    cluster: Cluster,
    installed: tuple[str, Path],
    processes: ProcessGroup,
    infergate_cli: list[str],
) -> None:
    """Valid for the API server, invalid for the operator: a False condition and a
    Warning Event (posted with the chart's rights), never a crash; the user's ConfigMap
    showing up makes the pool Accepted on a resync."""
    namespace, sa_kubeconfig = installed
    operator = run_operator(processes, infergate_cli, sa_kubeconfig, namespace, "operator")
    pool = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())
    pool["metadata"]["namespace"] = namespace
    pool["metadata"]["annotations"] = {"infergate.io/epp-config": "my-epp-config"}
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(pool))

    def accepted() -> str | None:
        body = cluster.get("inferencepool", "qwen-pool", namespace) or {}
        for parent in (body.get("status") or {}).get("parents") or []:
            for cond in parent.get("conditions") or []:
                if cond["type"] == "Accepted":
                    return f"{cond['status']}/{cond['reason']}"
        return None

    wait_for(lambda: accepted() == "False/EndpointPickerConfigNotFound", "config not found")
    assert cluster.get("deployment", "qwen-pool-epp", namespace) is None
    events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)[
        "items"
    ]
    assert any(
        e["type"] == "Warning" and e["reason"] == "EndpointPickerConfigNotFound" for e in events
    )

    user_config = (
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins:\n- type: queue-scorer\nschedulingProfiles:\n- name: default\n  plugins:\n"
        "  - pluginRef: queue-scorer\n"
    )
    cluster.kubectl(
        "create", "configmap", "my-epp-config", "-n", namespace,
        f"--from-literal=config.yaml={user_config}",
    )  # fmt: skip
    wait_for(lambda: accepted() == "True/Accepted", "accepted once the ConfigMap exists")
    managed = wait_for(
        functools.partial(cluster.get, "configmap", "qwen-pool-epp", namespace), "managed config"
    )
    assert managed["data"]["config.yaml"] == user_config

    cluster.kubectl(
        "annotate", "--overwrite", "inferencepool", "qwen-pool", "-n", namespace,
        "infergate.io/epp-replicas=many",
    )  # fmt: skip
    wait_for(lambda: accepted() == "False/InvalidAnnotation", "InvalidAnnotation")
    assert cluster.get("deployment", "qwen-pool-epp", namespace) is not None
    assert operator.alive()
