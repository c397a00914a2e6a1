"""The control-plane driver: the loopback data plane (:mod:`conformance.drivers.local`)
over a real API server.

* **The API server** is the real one the cluster tier builds
  (:class:`infergate.testing.controlplane.ControlPlane`: etcd, kube-apiserver with RBAC,
  controller-manager, scheduler, kwok).
* **The operator** is installed with the real ``helm`` (``charts/infergate``, all
  namespaces) and runs from this checkout as a process whose only credential is a
  TokenRequest token for the chart's ServiceAccount.
* **Pods** are the ones the real deployment and replicaset controllers make from the
  suite's Deployments; kwok runs them with IPs in the control plane's loopback /24, and
  the driver starts one echo server bound to each pod's IP (the container runtime's part).
* **Each pool's EPP** runs from the operator's Deployment as before, but with a
  TokenRequest token for the ServiceAccount the operator made for it, so the Role the
  operator granted is what the API server enforces on its watches. The EPP Deployment
  becomes Available through the real controllers and kwok.

Envoy and the EPP listen on 127.0.0.1 with free ports
(not on the EPP pod's IP), one Envoy per pool and the weighted front listener stand in
for a Gateway; there is no Gateway API implementation (HTTPRoute status tests skip).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conformance import topology as topo
from conformance.drivers.base import Pod
from conformance.drivers.local import LoopbackDriver, _Epp
from conformance.kube import KubeApi, api_client_for, wait_for
from infergate.procs import free_port, http_ready
from infergate.testing.controlplane import Cluster, ControlPlane

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_NS = "infergate-system"
RELEASE = "infergate"  # the chart's fullname is then "infergate"


class ControlPlaneDriver(LoopbackDriver):
    name = "controlplane"
    settle_timeout = 90.0

    def __init__(self, workdir: Path, cli: Sequence[str], bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.plane: ControlPlane | None = None
        super().__init__(workdir, cli)

    # LoopbackDriver.__init__ calls this first: bring the cluster up and learn the pods.
    def _assign_pods(self) -> None:
        self.plane = ControlPlane(bin_dir=self.bin_dir, workdir=self.workdir / "plane").start()
        self.cluster = Cluster(
            kubeconfig=self.plane.admin_kubeconfig, bin_dir=self.bin_dir, workdir=self.workdir
        )
        self.cluster.helm(
            "install", RELEASE, str(ROOT / "charts" / "infergate"), "-n", OPERATOR_NS,
            "--create-namespace", "--set", "operator.peering=",
        )  # fmt: skip
        kube = KubeApi(api_client_for(str(self.plane.admin_kubeconfig)))
        operator_kubeconfig = self.cluster.service_account_kubeconfig(OPERATOR_NS, RELEASE)
        liveness = free_port()
        self.group.start(
            "operator",
            [*self.cli, "operator", "--standalone", "--liveness",
             f"http://127.0.0.1:{liveness}/healthz"],
            ready=http_ready(f"http://127.0.0.1:{liveness}/healthz"), timeout=120.0,
            env=dict(os.environ, KUBECONFIG=str(operator_kubeconfig), INFERGATE_RESYNC_SECONDS="2"),
        )  # fmt: skip
        kube.apply_all(topo.base_objects())
        by_app: dict[str, list[Pod]] = {}
        for pool in topo.pools().values():
            if pool.app not in by_app:
                by_app[pool.app] = wait_for(
                    functools.partial(self._running_pods, kube, pool),
                    timeout=self.settle_timeout, what=f"{pool.replicas} pods of {pool.app}",
                )  # fmt: skip
            self._pods[pool.name] = by_app[pool.app]
        self._kube = kube

    @staticmethod
    def _running_pods(kube: KubeApi, pool: topo.PoolModel) -> list[Pod] | None:
        pods = [
            p
            for p in kube.list("Pod", pool.namespace, {"app": pool.app})
            if (p.get("status") or {}).get("phase") == "Running"
            and (p.get("status") or {}).get("podIP")
            and not p["metadata"].get("deletionTimestamp")
        ]
        if len(pods) < pool.replicas:
            return None
        return [
            Pod(p["metadata"]["name"], p["status"]["podIP"], pool.target_ports)
            for p in sorted(pods, key=lambda p: str(p["metadata"]["name"]))
        ]

    def _start_epp(self, epp: _Epp) -> None:
        """The EPP with its own ServiceAccount's token (the one the operator made)."""
        pool = next(p for p in topo.pools().values() if epp.name == f"epp-{p.name}")
        if epp.env is None or "INFERGATE_EPP_SA" not in epp.env:
            kubeconfig = self.cluster.service_account_kubeconfig(
                pool.namespace, pool.picker_service
            )
            epp.env = dict(os.environ, KUBECONFIG=str(kubeconfig), INFERGATE_EPP_SA="1")
        super()._start_epp(epp)

    def _mark_available(self, pool: topo.PoolModel) -> None:
        """The real deployment controller and kwok make the EPP Deployment Available."""
        kube = self.kube

        def available() -> Any:
            deployment = kube.get("Deployment", pool.namespace, pool.picker_service) or {}
            return (deployment.get("status") or {}).get("availableReplicas")

        wait_for(available, timeout=self.settle_timeout, what=f"{pool.picker_service} Available")

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.plane is not None:
                self.plane.stop()
