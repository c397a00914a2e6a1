"""A real Kubernetes control plane on loopback, from the binaries ``make controlplane`` builds.

What runs, each as its own process bound to 127.0.0.1 on free ports:

- ``etcd`` (one member, data in a temporary folder);
- ``kube-apiserver`` with RBAC authorization, ServiceAccount tokens signed by a key made
  here (so the TokenRequest API works), the default admission plugins, a static admin
  token in ``system:masters`` and an audit log of every write (:func:`audit_writes`);
- ``kube-controller-manager`` with its whole default set: garbage collector, namespace,
  deployment, replicaset, serviceaccount, endpointslice, node-lifecycle (kwok renews the
  node's Lease, which is its heartbeat) and the rest;
- ``kube-scheduler`` (binds pods to the fake node);
- ``kwok``, KWOK's fake-kubelet controller, driving one Node (``kwok-node-0``): the node
  becomes Ready, scheduled pods become Running and Ready with an IP from the node's pod
  CIDR, a random ``127.X.Y.0/24`` (so control planes side by side do not share pod IPs) -
  every such address is loopback on Linux, so a test can back a pod with a real process
  bound to the pod's IP.

What it does not emulate: a container runtime (no image is pulled, no container runs:
a pod is Running because kwok says so), kube-proxy and cluster networking (Service
ClusterIPs are allocated but route nowhere; only pod IPs on loopback are reachable),
probes, volumes, resource limits, and kubelet behaviour such as evictions.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from infergate.procs import ProcessGroup, free_port

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "tools" / "controlplane" / "build.sh"
BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "helm",
)
NODE_NAME = "kwok-node-0"


def random_pod_cidr() -> str:
    """A ``127.X.Y.0/24`` no other control plane on this machine is likely to use."""
    return f"127.{secrets.randbelow(99) + 1}.{secrets.randbelow(250) + 1}.0/24"


# KWOK stages, written for this harness: the node is Ready; a scheduled pod is Running and
# Ready with an IP from the node's pod CIDR; a pod being deleted goes away.
_KWOK_STAGES = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: infergate-node-ready}
spec:
  resourceRef: {apiGroup: v1, kind: Node}
  selector:
    matchExpressions:
      - {key: '.status.phase', operator: 'NotIn', values: ['Running']}
  next:
    statusTemplate: |
      {{ $now := Now }}
      phase: Running
      addresses:
        - {type: InternalIP, address: "127.0.0.1"}
      allocatable: {cpu: "64", memory: 256Gi, pods: "250"}
      capacity: {cpu: "64", memory: 256Gi, pods: "250"}
      conditions:
        - {type: Ready, status: "True", reason: KubeletReady, message: "kwok", lastHeartbeatTime: {{ $now | Quote }}, lastTransitionTime: {{ $now | Quote }}}
      nodeInfo: {architecture: amd64, operatingSystem: linux, kubeletVersion: fake}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: infergate-pod-running}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
      - {key: '.metadata.deletionTimestamp', operator: 'DoesNotExist'}
      - {key: '.status.phase', operator: 'In', values: ['Pending']}
  next:
    statusTemplate: |
      {{ $now := Now }}
      phase: Running
      startTime: {{ $now | Quote }}
      conditions:
        - {type: PodScheduled, status: "True", lastTransitionTime: {{ $now | Quote }}}
        - {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
        - {type: ContainersReady, status: "True", lastTransitionTime: {{ $now | Quote }}}
        - {type: Ready, status: "True", lastTransitionTime: {{ $now | Quote }}}
      containerStatuses:
      {{ range .spec.containers }}
        - {name: {{ .name | Quote }}, image: {{ .image | Quote }}, ready: true, started: true, restartCount: 0, state: {running: {startedAt: {{ $now | Quote }}}}}
      {{ end }}
      hostIP: "127.0.0.1"
      {{ with PodIPsWith .spec.nodeName false .metadata.uid .metadata.name .metadata.namespace }}
      podIP: {{ index . 0 | Quote }}
      podIPs:
      {{ range . }}
        - ip: {{ . | Quote }}
      {{ end }}
      {{ end }}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: infergate-pod-delete}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
      - {key: '.metadata.deletionTimestamp', operator: 'Exists'}
  next:
    delete: true
"""


_AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    verbs: [create, update, patch, delete, deletecollection]
  - level: None
"""


def audit_writes(audit_log: Path, user: str) -> list[str]:
    """``VERB /path`` of each write ``user`` made that the API server completed, in order."""
    writes: list[str] = []
    if not audit_log.exists():
        return writes
    for line in audit_log.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("stage") != "ResponseComplete":
            continue
        if (event.get("user") or {}).get("username") != user:
            continue
        writes.append(f"{event.get('verb')} {event.get('requestURI', '').split('?')[0]}")
    return writes


class ControlPlaneError(RuntimeError):
    """The control plane could not be built or started; the message says why."""


def binaries_dir() -> Path:
    """The version-keyed folder ``tools/controlplane/build.sh`` builds into (or
    ``$INFERGATE_CONTROLPLANE_BIN``)."""
    override = os.environ.get("INFERGATE_CONTROLPLANE_BIN")
    if override:
        return Path(override)
    try:
        out = subprocess.run(
            ["bash", str(BUILD_SCRIPT), "--print-dir"], capture_output=True, text=True,
            check=False,
        )  # fmt: skip
    except OSError as error:  # no bash on PATH
        raise ControlPlaneError(f"cannot run {BUILD_SCRIPT}: {error}") from error
    if out.returncode != 0:
        raise ControlPlaneError(out.stderr.strip() or "tools/controlplane/build.sh failed")
    return Path(out.stdout.strip().splitlines()[-1])


def missing_binaries(directory: Path) -> list[str]:
    """Which of the control-plane binaries are not built in ``directory``."""
    return [name for name in BINARIES if not os.access(directory / name, os.X_OK)]


def write_kubeconfig(path: Path, server: str, ca_file: Path, token: str, user: str) -> Path:
    """A kubeconfig for one bearer-token identity; ``path`` is written 0600."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "infergate-test",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_file.read_bytes()).decode(),
                },
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [
            {"name": user, "context": {"cluster": "infergate-test", "user": user}},
        ],
        "current-context": user,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def _service_account_key(directory: Path) -> tuple[Path, Path]:
    """An RSA key pair the API server signs and verifies ServiceAccount tokens with."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = directory / "sa.key"
    public = directory / "sa.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    private.chmod(0o600)
    return private, public


@dataclass
class ControlPlane:
    """A running control plane; :meth:`start` builds it, :meth:`stop` ends every process."""

    bin_dir: Path
    workdir: Path
    processes: ProcessGroup = field(default_factory=ProcessGroup)
    server: str = ""
    admin_token: str = ""
    admin_kubeconfig: Path = Path()
    ca_file: Path = Path()
    pod_cidr: str = field(default_factory=random_pod_cidr)
    audit_log: Path | None = None

    # -- lifecycle --------------------------------------------------------------------

    def start(self, timeout: float = 180.0) -> ControlPlane:
        missing = missing_binaries(self.bin_dir)
        if missing:
            raise ControlPlaneError(
                f"control-plane binaries missing in {self.bin_dir}: {', '.join(missing)}; "
                "run `make controlplane` (needs Go; see docs/kubernetes.md)"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._start(timeout)
        except Exception as error:
            logs = "\n".join(
                f"--- {p.name} (exit {p.popen.poll() if p.popen else None}):\n{p.log_tail(3000)}"
                for p in self.processes
            )
            self.stop()
            raise ControlPlaneError(f"control plane did not start: {error}\n{logs}") from error
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        wd = self.workdir
        b = self.bin_dir
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        self.processes.start(
            "etcd",
            [
                str(b / "etcd"), "--name=infergate-test", f"--data-dir={wd / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=infergate-test=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync=true", "--log-level=warn",
            ],
            ready=lambda: _http_ok(f"http://127.0.0.1:{etcd_port}/health"),
            timeout=timeout,
        )  # fmt: skip

        sa_key, sa_pub = _service_account_key(wd)
        self.admin_token = secrets.token_hex(24)
        tokens = wd / "tokens.csv"
        tokens.write_text(f'{self.admin_token},infergate-admin,infergate-admin,"system:masters"\n')
        tokens.chmod(0o600)
        # Every write, at Metadata level: tests read it to see who changed what.
        audit_policy = wd / "audit-policy.yaml"
        audit_policy.write_text(_AUDIT_POLICY)
        self.audit_log = wd / "audit.log"
        cert_dir = wd / "apiserver-certs"
        self.server = f"https://127.0.0.1:{api_port}"
        self.processes.start(
            "kube-apiserver",
            [
                str(b / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}", f"--cert-dir={cert_dir}",
                f"--token-auth-file={tokens}",
                "--authorization-mode=RBAC",
                f"--service-account-key-file={sa_pub}",
                f"--service-account-signing-key-file={sa_key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--allow-privileged=true",
                # The kubernetes Service cannot point at a loopback address: no endpoints.
                "--endpoint-reconciler-type=none",
                "--enable-priority-and-fairness=false",
                f"--audit-policy-file={audit_policy}", f"--audit-log-path={self.audit_log}",
                "--audit-log-mode=blocking",
                "--v=0",
            ],
            ready=lambda: self._api_ready(cert_dir),
            timeout=timeout,
        )  # fmt: skip
        # apiserver.crt is the self-signed serving certificate followed by its CA: the CA
        # alone is what clients trust and what the controller-manager publishes.
        blocks = (cert_dir / "apiserver.crt").read_text().split("-----END CERTIFICATE-----")
        ca = wd / "ca.crt"
        ca.write_text(blocks[-2].strip() + "\n-----END CERTIFICATE-----\n")
        self.ca_file = ca
        self.admin_kubeconfig = write_kubeconfig(
            wd / "admin.kubeconfig", self.server, self.ca_file, self.admin_token, "admin"
        )
        kc = str(self.admin_kubeconfig)
        self.processes.start(
            "kube-controller-manager",
            [
                str(b / "kube-controller-manager"), f"--kubeconfig={kc}",
                "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
                "--leader-elect=false", "--controllers=*",
                f"--service-account-private-key-file={sa_key}",
                f"--root-ca-file={self.ca_file}", "--use-service-account-credentials=true",
                "--concurrent-gc-syncs=5", "--v=0",
            ],
            # The serviceaccount controller made the default namespace's ServiceAccount.
            ready=lambda: self._exists("/api/v1/namespaces/default/serviceaccounts/default"),
            timeout=timeout,
        )  # fmt: skip
        self.processes.start(
            "kube-scheduler",
            [
                str(b / "kube-scheduler"), f"--kubeconfig={kc}",
                "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
                "--leader-elect=false", "--v=0",
            ],
        )  # fmt: skip
        stages = wd / "kwok-stages.yaml"
        stages.write_text(_KWOK_STAGES)
        self.processes.start(
            "kwok",
            [
                str(b / "kwok"), f"--kubeconfig={kc}", f"--config={stages}",
                "--manage-all-nodes=true", f"--server-address=127.0.0.1:{free_port()}",
                f"--cidr={self.pod_cidr}", "--node-ip=127.0.0.1",
                # kwok renews the node's Lease: the node-lifecycle controller's heartbeat.
                "--node-lease-duration-seconds=40",
            ],
        )  # fmt: skip
        self.api(
            "POST",
            "/api/v1/nodes",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": NODE_NAME,
                    "labels": {"kubernetes.io/hostname": NODE_NAME, "type": "kwok"},
                    "annotations": {"kwok.x-k8s.io/node": "fake"},
                },
                "spec": {"podCIDR": self.pod_cidr, "podCIDRs": [self.pod_cidr]},
            },
        )
        deadline = time.monotonic() + timeout
        while not self._node_ready():
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"node {NODE_NAME} did not become Ready under kwok")
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop every process (reverse order) and remove the working folder."""
        self.processes.stop_all()
        shutil.rmtree(self.workdir, ignore_errors=True)

    # -- API access -------------------------------------------------------------------

    def _ssl(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def api(
        self, method: str, path: str, body: Any = None, token: str | None = None
    ) -> dict[str, Any]:
        """One JSON call to the API server as the admin (or ``token``)."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.server + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {token or self.admin_token}")
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, context=self._ssl(), timeout=30) as response:
            text = response.read().decode()
        result: dict[str, Any] = json.loads(text) if text else {}
        return result

    def _exists(self, path: str) -> bool:
        try:
            self.api("GET", path)
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return False
            raise
        return True

    def _api_ready(self, cert_dir: Path) -> bool:
        if not (cert_dir / "apiserver.crt").exists():
            return False
        self.ca_file = cert_dir / "apiserver.crt"
        try:
            request = urllib.request.Request(self.server + "/readyz")
            request.add_header("Authorization", f"Bearer {self.admin_token}")
            with urllib.request.urlopen(request, context=self._ssl(), timeout=5) as response:
                return bool(response.status == 200)
        except (OSError, ssl.SSLError):
            return False

    def _node_ready(self) -> bool:
        node = self.api("GET", f"/api/v1/nodes/{NODE_NAME}")
        conditions = (node.get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)

    def service_account_token(
        self, namespace: str, name: str, expiration_seconds: int = 3600
    ) -> str:
        """A token for ServiceAccount ``namespace/name`` from the TokenRequest API."""
        result = self.api(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": expiration_seconds},
            },
        )
        return str(result["status"]["token"])

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path) -> Path:
        """A kubeconfig that acts as ServiceAccount ``namespace/name`` (a TokenRequest token)."""
        token = self.service_account_token(namespace, name)
        return write_kubeconfig(path, self.server, self.ca_file, token, f"{namespace}-{name}")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def running_control_plane(bin_dir: Path, workdir: Path) -> Iterator[ControlPlane]:
    """Start a control plane for the ``with`` block; always stopped after it."""
    plane = ControlPlane(bin_dir=bin_dir, workdir=workdir).start()
    try:
        yield plane
    finally:
        plane.stop()


@dataclass
class Cluster:
    """What the cluster tests get: an admin kubeconfig and the real ``kubectl``/``helm``.

    Works the same over the control plane started here and over a user's own cluster
    (``INFERGATE_TEST_KUBECONFIG``, e.g. a kind cluster): every identity other than the
    admin comes from the TokenRequest API, through ``kubectl create token``.
    """

    kubeconfig: Path
    bin_dir: Path
    workdir: Path
    local: bool = True
    #: The API server's audit log of writes (the local control plane only).
    audit_log: Path | None = None

    def tool(self, name: str) -> str:
        """Path of ``kubectl`` or ``helm``: the built one, else the one on PATH."""
        built = self.bin_dir / name
        if os.access(built, os.X_OK):
            return str(built)
        found = shutil.which(name)
        if found is None:
            raise ControlPlaneError(f"no {name}: run `make controlplane` or put it on PATH")
        return found

    def run(
        self,
        tool: str,
        *args: str,
        kubeconfig: Path | None = None,
        check: bool = True,
        stdin: str | None = None,
        timeout: float = 180.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``kubectl``/``helm`` with ``args`` as the admin (or ``kubeconfig``)."""
        env = dict(os.environ, KUBECONFIG=str(kubeconfig or self.kubeconfig))
        env.setdefault("HELM_CACHE_HOME", str(self.workdir / "helm-cache"))
        env.setdefault("HELM_CONFIG_HOME", str(self.workdir / "helm-config"))
        env.setdefault("HELM_DATA_HOME", str(self.workdir / "helm-data"))
        result = subprocess.run(
            [self.tool(tool), *args], capture_output=True, text=True, env=env, input=stdin,
            timeout=timeout, check=False,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise ControlPlaneError(
                f"{tool} {' '.join(args)} exited {result.returncode}:\n"
                f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
            )
        return result

    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.run("kubectl", *args, **kwargs)

    def helm(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.run("helm", *args, **kwargs)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """``kubectl get -o json`` as the admin; ``None`` when it does not exist."""
        ns = ["-n", namespace] if namespace else []
        result = self.kubectl("get", kind, name, *ns, "-o", "json", check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr or "not found" in result.stderr:
                return None
            raise ControlPlaneError(result.stderr)
        obj: dict[str, Any] = json.loads(result.stdout)
        return obj

    def service_account_kubeconfig(self, namespace: str, name: str) -> Path:
        """A kubeconfig that acts as ServiceAccount ``namespace/name`` (TokenRequest)."""
        token = self.kubectl(
            "create", "token", name, "-n", namespace, "--duration=2h"
        ).stdout.strip()
        raw = json.loads(self.kubectl("config", "view", "--raw", "--minify", "-o", "json").stdout)
        cluster = raw["clusters"][0]["cluster"]
        user = f"{namespace}-{name}"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "c", "cluster": cluster}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": user, "context": {"cluster": "c", "user": user}}],
            "current-context": user,
        }
        path = self.workdir / "kubeconfigs" / f"{user}.kubeconfig"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def can_i(self, kubeconfig: Path, *args: str) -> bool:
        """``kubectl auth can-i ARGS`` as ``kubeconfig``'s identity."""
        result = self.kubectl("auth", "can-i", *args, kubeconfig=kubeconfig, check=False)
        return result.stdout.strip() == "yes"
