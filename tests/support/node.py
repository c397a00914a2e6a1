"""A real Kubernetes node for the ``node`` tests: kubelet, containerd, runc, CNI, kube-proxy.

``tools/node/probe.sh up`` brings it up as root inside a network namespace it creates
(``infergate-node``): the project's control plane (the cluster tier's, without kwok),
Debian's containerd and runc with the CNI bridge on ``10.244.0.0/24``, and a kubelet and
kube-proxy built from k8s.io/kubernetes at the control plane's version. Pods run for real:
images are pulled from containerd's store (imported from OCI layouts, no registry), probes,
volumes, securityContext and resource limits are the kubelet's, and Services are
kube-proxy's iptables rules. ``tools/node/probe.sh down`` removes all of it. This module
drives the two and gives tests what they need from inside the namespace: a
:class:`~tests.support.controlplane.Cluster` whose ``kubectl``/``helm`` run there, HTTP
requests from there (ClusterIPs and pod IPs route only there), and image imports.

One node per machine at a time: the namespace, work folder and cgroup root have fixed
names (a second ``up`` first tears the first down). docs/kubernetes.md, "A real node".
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tests.support.controlplane import Cluster, ControlPlaneError

ROOT = Path(__file__).resolve().parents[2]
NODE_SCRIPT = ROOT / "tools" / "node" / "probe.sh"
NODE_BUILD = ROOT / "tools" / "node" / "build.sh"
CONTROLPLANE_BUILD = ROOT / "tools" / "controlplane" / "build.sh"
WORKDIR = Path(os.environ.get("INFERGATE_NODE_WORKDIR", "/var/tmp/infergate-node"))
REF_NAME = "org.opencontainers.image.ref.name"  # an OCI index entry's tag


class NodeError(RuntimeError):
    """The node could not be brought up, or a command on it failed; the message says why."""


def unavailable_reason() -> str | None:
    """Why the node cannot run here, or ``None``: it needs root (namespaces, cgroups,
    mounts), Go to build the kubelet (unless already built), and bash."""
    if os.geteuid() != 0:
        return "needs root (network namespace, cgroups, mounts): run `sudo make test-node`"
    if shutil.which("bash") is None:
        return "needs bash (tools/node/probe.sh)"
    if shutil.which("go") is None and not _built():
        return "needs Go to build kubelet, kube-proxy and the control plane (none built yet)"
    return None


def _built() -> bool:
    """Whether the node's and the control plane's binaries are in their caches."""
    for script, names in (
        (NODE_BUILD, ("kubelet", "kube-proxy")),
        (CONTROLPLANE_BUILD, ("kube-apiserver", "kubectl", "helm")),
    ):
        out = subprocess.run(
            ["bash", str(script), "--print-dir"], capture_output=True, text=True, check=False
        )
        if out.returncode != 0:
            return False
        folder = Path(out.stdout.strip().splitlines()[-1])
        if not all(os.access(folder / name, os.X_OK) for name in names):
            return False
    return True


def _read_env(path: Path) -> dict[str, str]:
    """``KEY=value`` lines, as probe.sh's ``write_env`` writes them."""
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {key: value for key, value in pairs}


@dataclass
class Node:
    """A running node; :meth:`start` brings it up, :meth:`stop` tears everything down."""

    workdir: Path = WORKDIR
    env: dict[str, str] = field(default_factory=dict)
    cluster: Cluster | None = None

    def start(self, timeout: float = 1800.0) -> Node:
        """``probe.sh up``: builds (cached) and starts everything; raises :class:`NodeError`
        with the script's output if the node did not come up (it tears itself down then)."""
        result = self._script("up", timeout)
        env_file = self.workdir / "node.env"
        if result.returncode != 0 or not env_file.exists():
            raise NodeError(
                f"tools/node/probe.sh up exited {result.returncode}:\n{result.stderr[-6000:]}"
            )
        self.env = _read_env(env_file)
        self.cluster = Cluster(
            kubeconfig=Path(self.env["KUBECONFIG"]),
            bin_dir=Path(self.env["TOOLS"]),
            workdir=Path(tempfile.mkdtemp(prefix="infergate-node-tests-")),
        )
        return self

    def stop(self) -> None:
        """``probe.sh down``: stops every process, removes pods' containers, mounts,
        cgroups, namespaces and the work folder, restores the host sysctls. Logs are kept
        in ``/var/tmp/infergate-node-logs``."""
        self._script("down", 300.0)
        if self.cluster is not None:
            shutil.rmtree(self.cluster.workdir, ignore_errors=True)

    def _script(self, command: str, timeout: float) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, INFERGATE_NODE_WORKDIR=str(self.workdir))
        return subprocess.run(
            ["bash", str(NODE_SCRIPT), command], capture_output=True, text=True, env=env,
            timeout=timeout, check=False, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    # -- inside the namespace ---------------------------------------------------------

    def run(
        self, *argv: str, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in the node's network namespace, where ClusterIPs and pod IPs route."""
        result = subprocess.run(
            ["nsenter", f"--net={self.env['NETNS']}", "--", *argv], capture_output=True,
            text=True, timeout=timeout, check=False,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise NodeError(
                f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout[-2000:]}\n"
                f"{result.stderr[-2000:]}"
            )
        return result

    def popen(self, *argv: str) -> subprocess.Popen[str]:
        """Start ``argv`` in the node's namespace, in the background: its stdin, stdout
        and stderr are pipes (text)."""
        return subprocess.Popen(
            ["nsenter", f"--net={self.env['NETNS']}", "--", *argv], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def http_get(self, url: str, timeout: float = 5.0) -> tuple[int, str]:
        """``GET url`` from the namespace: (status, body); status 0 if nothing answered."""
        result = self.run(
            "curl", "-s", "--max-time", str(timeout), "-w", "\n%{http_code}", url,
            check=False, timeout=timeout + 10,
        )  # fmt: skip
        body, _, code = result.stdout.rpartition("\n")
        return int(code or 0), body

    def container_pid(self, container_id: str) -> int:
        """The host pid of a running container's main process (runc's state of it)."""
        state = subprocess.run(
            ["runc", "--root", str(self.workdir / "containerd" / "runc" / "k8s.io"), "state",
             container_id], capture_output=True, text=True, check=False, timeout=30,
        )  # fmt: skip
        if state.returncode != 0:
            raise NodeError(f"runc state {container_id}: {state.stderr.strip()}")
        return int(json.loads(state.stdout)["pid"])

    # -- images -----------------------------------------------------------------------

    def import_layout(self, layout: Path, repository: str, tag_suffix: str = "") -> list[str]:
        """Import an OCI image layout (``make images``' ``build/images/<name>``) into
        containerd's ``k8s.io`` namespace as ``repository:<tag>`` (each tag the layout's
        index names, plus ``tag_suffix``: the chart names the CUDA engine ``<tag>-cuda``), where
        the kubelet finds it without a registry; returns those names."""
        if not (layout / "oci-layout").is_file():
            raise NodeError(f"{layout} is not an OCI image layout (no oci-layout file)")
        # The layout as a tar stream on ctr's stdin: an engine image is gigabytes.
        tar = subprocess.Popen(["tar", "-C", str(layout), "-cf", "-", "."], stdout=subprocess.PIPE)
        try:
            self._ctr("images", "import", "--base-name", repository, "-", stdin=tar.stdout)
        finally:
            if tar.stdout is not None:
                tar.stdout.close()
            tar.wait()
        index = json.loads((layout / "index.json").read_text())
        tags = [
            (manifest.get("annotations") or {}).get(REF_NAME) for manifest in index["manifests"]
        ]
        names = [f"{repository}:{tag}" for tag in tags if tag]
        if tag_suffix:
            for name in names:
                self._ctr("images", "tag", "--force", name, name + tag_suffix)
                self._ctr("images", "rm", name)
            names = [name + tag_suffix for name in names]
        held = set(self._ctr("images", "ls", "-q").stdout.split())
        return [name for name in names if name in held]

    def _ctr(self, *args: str, stdin: IO[bytes] | None = None) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["ctr", "--address", self.env["CONTAINERD_SOCKET"], "-n", "k8s.io", *args],
            capture_output=True, text=True, timeout=1200, check=False, stdin=stdin,
        )  # fmt: skip
        if result.returncode != 0:
            raise NodeError(f"ctr {' '.join(args)} exited {result.returncode}: {result.stderr}")
        return result

    def log_tail(self, name: str, chars: int = 4000) -> str:
        """The end of a node daemon's log (kubelet, containerd, kube-proxy, controlplane)."""
        path = Path(self.env.get("LOGS", str(self.workdir / "log"))) / f"{name}.log"
        try:
            return path.read_text(errors="replace")[-chars:]
        except OSError as error:
            return f"(no log: {error})"

    def container_logs(self, namespace: str, chars: int = 3000) -> str:
        """The end of every container log of ``namespace``'s pods, as the kubelet wrote them
        (``kubectl logs`` needs the API server to reach the kubelet, which this node lacks)."""
        root = Path(self.env.get("LOGS", str(self.workdir / "log"))) / "pods"
        parts = []
        for path in sorted(root.glob(f"{namespace}_*/*/*.log")):
            text = path.read_text(errors="replace")[-chars:]
            parts.append(f"--- {path.relative_to(root)}\n{text}")
        return "\n".join(parts) or f"(no container logs of {namespace} under {root})"


def require_cluster(node: Node) -> Cluster:
    """The node's cluster access; a started node always has one."""
    if node.cluster is None:
        raise ControlPlaneError("the node is not started")
    return node.cluster
