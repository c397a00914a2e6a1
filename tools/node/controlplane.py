"""Hold the project's control plane for ``tools/node/probe.sh`` until SIGTERM.

The probe needs the same control plane the cluster tests use (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler from ``tools/controlplane``), started by the same
harness, but with a real kubelet as its only node. The harness also starts kwok with
``--manage-all-nodes``, which would take over the real node and mark its pods Running
without running them; so this stops kwok and deletes kwok's node before writing
``<workdir>/controlplane.env`` (``SERVER=``, ``KUBECONFIG=``, ``CA=``), which the probe
waits for. Run it inside the probe's network namespace.

Pods reach the API server as on any node: through the ``kubernetes`` Service
(``10.96.0.1:443``, what in-cluster clients dial), whose endpoint is the node's address.
The harness binds the API server to 127.0.0.1 with no endpoints (kwok's pods are loopback
processes); here its process group changes that one command line: ``--bind-address=0.0.0.0``
(the namespace's loopback and the node address), ``--advertise-address`` the node address,
and the default ``lease`` endpoint reconciler, which publishes that address as the Service's
endpoint. Its serving certificate is made here before it starts (the API server uses the
``apiserver.crt``/``.key`` it finds in ``--cert-dir``): signed by a CA of its own, for
127.0.0.1 (the harness's URL), the node address, the Service's IP and its DNS names, as
kube-apiserver's self-signed one is for its bind and advertise addresses.

Usage: python tools/node/controlplane.py WORKDIR NODE_IP
"""

from __future__ import annotations

import datetime
import ipaddress
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from infergate.procs import ManagedProcess, ProcessGroup  # noqa: E402
from tests.support.controlplane import NODE_NAME, ControlPlane, binaries_dir  # noqa: E402

SERVICE_IP = "10.96.0.1"  # the kubernetes Service: first address of the harness's range
SERVICE_NAMES = ("kubernetes", "kubernetes.default", "kubernetes.default.svc",
                 "kubernetes.default.svc.cluster.local", "localhost")  # fmt: skip

_STOP = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def serving_certificate(cert_dir: Path, node_ip: str) -> None:
    """``apiserver.crt`` (serving certificate, then its CA: the harness trusts the last
    block) and ``apiserver.key`` for every address a client of this node dials."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key: Any, issuer: Any, signer: Any, ca: bool) -> Any:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        builder = (
            x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )  # fmt: skip
        if not ca:
            ips = [ipaddress.ip_address(a) for a in ("127.0.0.1", node_ip, SERVICE_IP)]
            alt = [*map(x509.IPAddress, ips), *map(x509.DNSName, SERVICE_NAMES)]
            builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("infergate-node-apiserver-ca", ca_key, None, ca_key, ca=True)
    leaf = cert("kube-apiserver", key, ca.subject, ca_key, ca=False)
    pem = serialization.Encoding.PEM
    cert_dir.mkdir(parents=True, exist_ok=True)
    (cert_dir / "apiserver.crt").write_bytes(leaf.public_bytes(pem) + ca.public_bytes(pem))
    (cert_dir / "apiserver.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    (cert_dir / "apiserver.key").chmod(0o600)


class NodeProcesses(ProcessGroup):
    """The harness's processes, with the API server serving the node as well (above)."""

    def __init__(self, node_ip: str) -> None:
        super().__init__()
        self.node_ip = node_ip

    def start(self, name: str, argv: Sequence[str], **kwargs: Any) -> ManagedProcess:
        if name == "kube-apiserver":
            argv = [
                self._node_flag(arg) for arg in argv if arg != "--endpoint-reconciler-type=none"
            ]
            cert_dir = next(a.split("=", 1)[1] for a in argv if a.startswith("--cert-dir="))
            serving_certificate(Path(cert_dir), self.node_ip)
        return super().start(name, argv, **kwargs)

    def _node_flag(self, arg: str) -> str:
        if arg.startswith("--bind-address="):
            return "--bind-address=0.0.0.0"
        if arg.startswith("--advertise-address="):
            return f"--advertise-address={self.node_ip}"
        return arg


def hold(workdir: Path, node_ip: str) -> None:
    """Start the control plane, drop kwok and its node, publish the access, wait for a signal."""
    plane = ControlPlane(
        bin_dir=binaries_dir(), workdir=workdir / "controlplane", processes=NodeProcesses(node_ip)
    ).start()
    # Blocked only now: the control plane's children must not inherit a blocked SIGTERM.
    # A signal before this point kills us, and the children die with us (PR_SET_PDEATHSIG).
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP)
    try:
        for process in plane.processes:
            if process.name == "kwok":
                process.stop()
        plane.api("DELETE", f"/api/v1/nodes/{NODE_NAME}")
        env = workdir / "controlplane.env"
        env.with_suffix(".tmp").write_text(
            f"SERVER={plane.server}\nKUBECONFIG={plane.admin_kubeconfig}\nCA={plane.ca_file}\n"
        )
        env.with_suffix(".tmp").rename(env)
        print(f"control plane up at {plane.server}", flush=True)
        signal.sigwait(_STOP)
    finally:
        plane.stop()


def main() -> None:
    """Entry point."""
    if len(sys.argv) != 3:
        sys.exit("usage: tools/node/controlplane.py WORKDIR NODE_IP")
    hold(Path(sys.argv[1]), sys.argv[2])


if __name__ == "__main__":
    main()
