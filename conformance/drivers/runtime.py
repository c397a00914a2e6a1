"""The container runtime of the control-plane driver: processes for the pods kwok runs.

kwok gives every pod a phase, a Ready condition and an IP in the control plane's
``127.X.Y.0/24`` (Linux routes all of 127/8 to ``lo``), but runs nothing. This runtime is
the kubelet's other half for the suite's namespaces: it watches their pods and, for each
running pod, starts one process per container whose image it knows, through the
project's pod harness (:mod:`tests.support.pods`: ConfigMap volumes written locally,
in-pod addresses made the pod's IP, the ServiceAccount's token as a kubeconfig), with
the container's ``env`` and ``$(VAR)``-expanded args:

* ``…conformance-echo…`` → ``conformance/echo/server.py`` on the pod's IP;
* ``…sse-backend…`` → :mod:`tests.support.xds_harness`'s streaming backend on the
  pod's IP (the route-change benchmark's backends: ``GET /sse`` streams events);
* ``…/epp…`` → ``infergate`` from this checkout;
* ``…envoy…`` → the real Envoy on the bootstrap from the Gateway's ConfigMap. One thing
  more is changed there, what cluster DNS would provide: the static cluster the
  bootstrap names for ADS dials the operator process's xDS port instead of the xDS
  Service's name. Listeners, routes and clusters still come from the operator over xDS.

A pod that disappears (or changes IP) has its processes stopped. A pod can be held
stopped behind the API server's back (the fallback-list test).
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from conformance.kube import KubeApi
from infergate.envoy.binary import find_envoy
from infergate.procs import ManagedProcess, ProcessGroup
from tests.support import xds_harness
from tests.support.controlplane import Cluster, ControlPlaneError
from tests.support.pods import (
    container_env,
    expand,
    materialize_volumes,
    pod_argv,
    pod_env,
)

log = logging.getLogger("conformance.runtime")

ECHO_SERVER = Path(__file__).resolve().parents[1] / "echo" / "server.py"
Obj = dict[str, Any]


@dataclass(frozen=True)
class PodKey:
    namespace: str
    name: str
    uid: str
    ip: str


def container_kind(image: str) -> str | None:
    """Which process stands in for an image (None: one this runtime cannot run)."""
    name = image.rsplit("/", 1)[-1]
    if "conformance-echo" in name:
        return "echo"
    if "sse-backend" in name:
        return "sse"
    if name.startswith("epp"):
        return "epp"
    if "envoy" in image:
        return "envoy"
    return None


def redirect_ads(bootstrap: Obj, xds: tuple[str, int]) -> Obj:
    """The bootstrap with the static cluster its ADS config names dialling ``xds``
    (cluster DNS would resolve the operator's xDS Service there); nothing else changes."""
    out = copy.deepcopy(bootstrap)
    ads = ((out.get("dynamic_resources") or {}).get("ads_config") or {}).get("grpc_services") or []
    names = {(s.get("envoy_grpc") or {}).get("cluster_name") for s in ads}
    host, port = xds
    address = {"socket_address": {"address": host, "port_value": port}}
    for cluster in (out.get("static_resources") or {}).get("clusters") or []:
        if cluster.get("name") in names:
            cluster["type"] = "STATIC"
            cluster.pop("dns_lookup_family", None)
            cluster["load_assignment"] = {
                "cluster_name": cluster["name"],
                "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
            }
    return out


def _expanded(container: Obj, env: Mapping[str, str]) -> Obj:
    """The container with ``$(VAR)`` expanded in its command and args."""
    out = dict(container)
    for field in ("command", "args"):
        out[field] = [expand(str(a), env) for a in container.get(field) or []]
    return out


class PodRuntime:
    """Keeps one process per known container of every running pod in ``namespaces``."""

    def __init__(
        self,
        kube: KubeApi,
        cluster: Cluster,
        workdir: Path,
        *,
        namespaces: Sequence[str],
        cli: Sequence[str],
        xds: tuple[str, int],
        interval: float = 0.5,
    ) -> None:
        self.kube = kube
        self.cluster = cluster
        self.workdir = workdir
        self.namespaces = list(namespaces)
        self.cli = list(cli)
        self.xds = xds
        self.interval = interval
        self.group = ProcessGroup()
        self.errors: list[str] = []
        self._running: dict[PodKey, list[ManagedProcess]] = {}
        self._held: set[tuple[str, str]] = set()  # pods stopped on purpose
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pod-runtime", daemon=True)

    def start(self) -> PodRuntime:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sync()
            except Exception as error:  # the kubelet stays up; the failure is reported
                self.errors.append(f"sync failed: {error!r}")
                log.exception("pod runtime sync failed")

    def sync(self) -> None:
        """Start processes for new running pods, stop those of pods that went away."""
        with self._lock:
            live = {k: p for k, p in self._pods() if (k.namespace, k.name) not in self._held}
            for key in [k for k in self._running if k not in live]:
                self._stop_pod(key)
            for key, pod in live.items():
                if key not in self._running and not self._stop.is_set():
                    self._try_start(key, pod)

    def _try_start(self, key: PodKey, pod: Obj) -> None:
        """Start a pod's containers; one that cannot start yet (a ConfigMap it mounts
        does not exist yet, as a kubelet would wait for it) is retried on the next sync."""
        try:
            self._running[key] = self._start_pod(key, pod)
        except (AssertionError, ControlPlaneError, OSError) as error:
            self.errors.append(f"{key.name} not started yet: {error}")
            for process in [p for p in self.group.processes if key.name in p.name]:
                process.stop()
                self.group.processes.remove(process)

    def _pods(self) -> Iterator[tuple[PodKey, Obj]]:
        for namespace in self.namespaces:
            for pod in self.kube.list("Pod", namespace):
                status, meta = pod.get("status") or {}, pod["metadata"]
                if status.get("phase") != "Running" or not status.get("podIP"):
                    continue
                if not meta.get("deletionTimestamp"):
                    key = PodKey(namespace, meta["name"], meta.get("uid", ""), status["podIP"])
                    yield key, pod

    def _start_pod(self, key: PodKey, pod: Obj) -> list[ManagedProcess]:
        folder = self.workdir / key.namespace / key.name
        folder.mkdir(parents=True, exist_ok=True)
        started = []
        for container in (pod.get("spec") or {}).get("containers") or []:
            kind = container_kind(str(container.get("image", "")))
            if kind is None:
                self.errors.append(f"{key.name}: no runtime for image {container.get('image')}")
                continue
            argv, env = self._command(kind, pod, container, folder)
            name, log_path = (
                f"{kind}-{key.name}-{container['name']}",
                folder / f"{container['name']}.log",
            )
            started.append(self.group.start(name, argv, env=env, log_path=log_path))
        return started

    def _command(
        self, kind: str, pod: Obj, container: Obj, folder: Path
    ) -> tuple[list[str], dict[str, str]]:
        """argv and environment of one container's stand-in process."""
        env = container_env(pod, container)
        expanded = _expanded(container, env)
        mounts = materialize_volumes(self.cluster, pod, container, folder / "volumes")
        ip = str(pod["status"]["podIP"])
        if kind == "echo":
            argv = pod_argv(
                pod, {**expanded, "command": []}, [sys.executable, str(ECHO_SERVER)], mounts
            )
            return [*argv, "--host", ip], {**_base_env(), **env}
        if kind == "sse":
            entry = [sys.executable, xds_harness.__file__]
            argv = pod_argv(pod, {**expanded, "command": []}, entry, mounts)
            return [*argv, "--host", ip], {**_base_env(), **env}
        if kind == "epp":
            argv = pod_argv(pod, {**expanded, "command": []}, self.cli, mounts)
            return argv, {**pod_env(self.cluster, pod), **env}
        argv = pod_argv(pod, {**expanded, "command": []}, [str(find_envoy())], mounts)
        return self._with_local_bootstrap(argv, folder), {**_base_env(), **env}

    def _with_local_bootstrap(self, argv: list[str], folder: Path) -> list[str]:
        """Envoy's argv with its bootstrap's ADS cluster dialling the operator's port."""
        out = list(argv)
        for flag in ("-c", "--config-path"):
            if flag in out:
                source = Path(out[out.index(flag) + 1])
                local = folder / "bootstrap.local.yaml"
                bootstrap = redirect_ads(yaml.safe_load(source.read_text()), self.xds)
                local.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
                out[out.index(flag) + 1] = str(local)
        if "--disable-hot-restart" not in out:
            out.append("--disable-hot-restart")  # several pods share this machine's shm
        return out

    def _stop_pod(self, key: PodKey) -> None:
        for process in self._running.pop(key, []):
            process.stop()
            if process in self.group.processes:
                self.group.processes.remove(process)

    def hold(self, namespace: str, name: str) -> None:
        """Stop a pod's processes and keep them stopped (the API still says Running)."""
        with self._lock:
            self._held.add((namespace, name))
            for key in [k for k in self._running if (k.namespace, k.name) == (namespace, name)]:
                self._stop_pod(key)

    def release(self, namespace: str, name: str) -> None:
        """Let a held pod run again (now)."""
        with self._lock:
            self._held.discard((namespace, name))
        self.sync()

    def logs(self) -> Iterator[tuple[str, str]]:
        for process in list(self.group):
            yield process.name, process.log_tail(3000)
        if self.errors:
            yield "pod-runtime", "\n".join(self.errors[-20:])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.group.stop_all()


def _base_env() -> dict[str, str]:
    return dict(os.environ)
