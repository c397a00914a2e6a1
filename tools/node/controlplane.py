"""Hold the project's control plane for ``tools/node/probe.sh`` until SIGTERM.

The probe needs the same control plane the cluster tests use (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler from ``tools/controlplane``), started by the same
harness, but with a real kubelet as its only node. The harness also starts kwok with
``--manage-all-nodes``, which would take over the real node and mark its pods Running
without running them; so this stops kwok and deletes kwok's node before writing
``<workdir>/controlplane.env`` (``SERVER=``, ``KUBECONFIG=``, ``CA=``), which the probe
waits for. Run it inside the probe's network namespace: every address it binds is the
namespace's own loopback.

Usage: python tools/node/controlplane.py WORKDIR
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.controlplane import NODE_NAME, ControlPlane, binaries_dir  # noqa: E402

_STOP = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def hold(workdir: Path) -> None:
    """Start the control plane, drop kwok and its node, publish the access, wait for a signal."""
    plane = ControlPlane(bin_dir=binaries_dir(), workdir=workdir / "controlplane").start()
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
    if len(sys.argv) != 2:
        sys.exit("usage: tools/node/controlplane.py WORKDIR")
    hold(Path(sys.argv[1]))


if __name__ == "__main__":
    main()
