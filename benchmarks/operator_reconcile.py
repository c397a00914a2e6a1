"""Operator reconcile cost: API requests and time per pool, first apply vs steady state.

Runs the real reconcile (the code `infergate operator` runs per pool) against the real
control plane the cluster tier uses (etcd, kube-apiserver, controller-manager,
scheduler and kwok, from the binaries `make controlplane` builds), for N pools with M
ready pods each (a Deployment per pool; the real controllers make the pods and kwok runs
them), and prints per-reconcile latency and the operator's own request counts. The API
server is on loopback, so the times are the operator's cost plus a real API server's
answer, without network latency.

    python benchmarks/operator_reconcile.py [--pools 20] [--pods 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from infergate.operator.kube import Kube
from infergate.operator.reconcile import reconcile
from infergate.operator.settings import OperatorSettings

# The test harness (tests/support/) is a folder of this checkout, not an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.controlplane import Cluster, binaries_dir, running_control_plane

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "default"


class CountingKube(Kube):
    """The operator's client, counting the requests it makes (writes apart)."""

    requests = 0
    writes = 0

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        self.requests += 1
        self.writes += method != "GET"
        return super().call(method, path, **kwargs)


def admin_client(kubeconfig: Path) -> Any:
    """A kubernetes ApiClient for the control plane's admin kubeconfig."""
    import kubernetes

    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(str(kubeconfig), client_configuration=configuration)
    return kubernetes.client.ApiClient(configuration)


def pool_objects(name: str, pods: int) -> list[dict[str, Any]]:
    """One InferencePool (the valid example, renamed) and the Deployment of its pods."""
    template = yaml.safe_load((ROOT / "crds/examples/valid/inferencepool.yaml").read_text())
    pool = copy.deepcopy(template)
    pool["metadata"] = {"name": name, "namespace": NAMESPACE}
    pool["spec"]["selector"]["matchLabels"] = {"app": name}
    pool["spec"]["endpointPickerRef"]["name"] = f"{name}-epp"
    labels = {"app": name}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "replicas": pods,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "engine", "image": "registry.example/engine"}]},
            },
        },
    }
    return [pool, deployment]


def wait_running(cluster: Cluster, expected: int, timeout: float = 600.0) -> None:
    """Until ``expected`` pods in the namespace are Running (kwok's doing)."""
    deadline = time.monotonic() + timeout
    while True:
        out = cluster.kubectl("get", "pods", "-n", NAMESPACE, "-o", "json").stdout
        running = sum(
            1 for p in json.loads(out)["items"] if (p.get("status") or {}).get("phase") == "Running"
        )
        if running >= expected:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"only {running} of {expected} pods Running after {timeout:.0f} s")
        time.sleep(1.0)


def timed_round(kube: CountingKube, names: list[str]) -> tuple[list[float], int, int]:
    settings = OperatorSettings()
    latencies, requests, writes = [], kube.requests, kube.writes
    for name in names:
        start = time.perf_counter()
        reconcile(kube, NAMESPACE, name, settings)
        latencies.append((time.perf_counter() - start) * 1000)
    return latencies, kube.requests - requests, kube.writes - writes


def settle(kube: CountingKube, names: list[str], timeout: float = 300.0) -> int:
    """Reconcile until a round writes nothing: the EPP Deployments the first round made
    become Available (real controllers, kwok) and each pool's status follows once. Returns
    the writes that took, so the steady rounds measure a pool where nothing changes."""
    deadline = time.monotonic() + timeout
    total = 0
    while True:
        _, _, writes = timed_round(kube, names)
        total += writes
        if writes == 0:
            return total
        if time.monotonic() > deadline:
            raise SystemExit(f"pools still changing after {timeout:.0f} s")
        time.sleep(1.0)


def row(label: str, lat: list[float], requests: float, writes: float) -> str:
    p50 = statistics.median(lat)
    p95 = sorted(lat)[max(0, int(len(lat) * 0.95) - 1)]
    return f"| {label} | {p50:.1f} | {p95:.1f} | {requests:.1f} | {writes:.1f} |"


def main(pools: int, pods: int, rounds: int) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="operator-reconcile-"))
    bin_dir = binaries_dir()
    with running_control_plane(bin_dir, workdir / "plane") as plane:
        cluster = Cluster(kubeconfig=plane.admin_kubeconfig, bin_dir=bin_dir, workdir=workdir)
        cluster.kubectl("apply", "--server-side", "-k", str(ROOT / "crds"))
        cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
        names = [f"pool-{i}" for i in range(pools)]
        objects = [obj for name in names for obj in pool_objects(name, pods)]
        listing = {"apiVersion": "v1", "kind": "List", "items": objects}
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(listing))
        wait_running(cluster, pools * pods)
        kube = CountingKube(admin_client(plane.admin_kubeconfig))
        first, first_requests, first_writes = timed_round(kube, names)
        settle_writes = settle(kube, names)
        steady: list[float] = []
        steady_requests = steady_writes = 0
        for _ in range(rounds):
            lat, req, wr = timed_round(kube, names)
            steady += lat
            steady_requests += req
            steady_writes += wr

    print(f"{pools} pools x {pods} Running pods, {rounds} steady rounds, real kube-apiserver")
    print("| reconcile | p50 ms | p95 ms | API requests/pool | writes/pool |")
    print("|---|---:|---:|---:|---:|")
    print(
        row("first (apply 6 objects + status)", first, first_requests / pools, first_writes / pools)
    )
    print(
        f"settling: {settle_writes / pools:.1f} writes/pool (status, as the EPPs became Available)"
    )
    steady_per_pool = pools * rounds
    print(
        row("steady (nothing changed)", steady, steady_requests / steady_per_pool,
            steady_writes / steady_per_pool)
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--pools", type=int, default=20)
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    main(args.pools, args.pods, args.rounds)
