"""The container runtime of the control-plane driver: processes for the pods kwok runs.

kwok gives every pod a phase, a Ready condition and an IP in the control plane's
``127.X.Y.0/24`` (Linux routes all of 127/8 to ``lo``), but runs nothing. This runtime is
the kubelet's other half: it watches the pods of the suite's namespaces and, for each
running pod, starts one process per container it knows the image of, bound to the pod's
IP, with the container's ``env`` (``fieldRef`` resolved), its ``args`` (``$(VAR)``
expanded as Kubernetes does) and its ConfigMap volumes written to a folder that stands in
for the mount path:

* ``…/conformance-echo…`` → ``conformance/echo/server.py``;
* ``…/epp…`` → ``infergate`` from this checkout, with a kubeconfig holding a TokenRequest
  token of the pod's ServiceAccount (what the kubelet would mount);
* ``…envoy…`` → the real Envoy binary on the bootstrap from the pod's ConfigMap, with only
  what the container network and cluster DNS would provide replaced: the static cluster
  the bootstrap names for ADS points at the operator process's xDS port (cluster DNS
  would resolve the operator's Service to it), and the admin and static listeners that
  bind a wildcard or loopback address bind the pod's IP (in a pod they are the pod's own
  network namespace). Listeners, routes and clusters still come from the operator over
  xDS.

A pod that disappears (or changes IP) has its processes stopped. Single pods can be
stopped and started again behind the API server's back (the fallback-list test).
"""

from __future__ import annotations

import copy
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from conformance.kube import KubeApi
from infergate.envoy.binary import find_envoy
from infergate.procs import ManagedProcess, ProcessGroup

log = logging.getLogger("conformance.runtime")

ECHO_SERVER = Path(__file__).resolve().parents[1] / "echo" / "server.py"
Obj = dict[str, Any]
#: (namespace, service account) → a kubeconfig holding that account's token.
TokenSource = Callable[[str, str], Path]
_LOCAL_BINDS = ("0.0.0.0", "::", "127.0.0.1", "localhost")


@dataclass(frozen=True)
class PodKey:
    namespace: str
    name: str
    uid: str
    ip: str


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of command and args: known names are replaced,
    ``$$(`` escapes, unknown references stay as written."""

    def one(match: re.Match[str]) -> str:
        if match.group(0).startswith("$$"):
            return match.group(0)[1:]
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$?\(([A-Za-z_][A-Za-z0-9_.-]*)\)", one, text)


def container_env(pod: Obj, container: Obj) -> dict[str, str]:
    """The container's ``env`` with the ``fieldRef`` values the kubelet would fill in."""
    fields = {
        "metadata.name": pod["metadata"]["name"],
        "metadata.namespace": pod["metadata"]["namespace"],
        "metadata.uid": pod["metadata"].get("uid", ""),
        "status.podIP": (pod.get("status") or {}).get("podIP", ""),
        "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName", "default"),
        "spec.nodeName": (pod.get("spec") or {}).get("nodeName", ""),
    }
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
        ref = ((item.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        if ref in fields:
            env[item["name"]] = fields[ref]
    return env


def container_kind(image: str) -> str | None:
    """Which process stands in for an image (None: one this runtime cannot run)."""
    name = image.rsplit("/", 1)[-1]
    if "conformance-echo" in name:
        return "echo"
    if name.startswith("epp"):
        return "epp"
    if "envoy" in image:
        return "envoy"
    return None


def rewrite_bootstrap(bootstrap: Obj, pod_ip: str, xds: tuple[str, int]) -> Obj:
    """A Gateway proxy's bootstrap as it behaves inside its pod on this machine: the ADS
    cluster dials the operator's xDS server at ``xds``; admin and static listeners that
    bind a wildcard or loopback address bind the pod's IP."""
    out = copy.deepcopy(bootstrap)
    ads = ((out.get("dynamic_resources") or {}).get("ads_config") or {}).get("grpc_services") or []
    names = {(s.get("envoy_grpc") or {}).get("cluster_name") for s in ads}
    for cluster in (out.get("static_resources") or {}).get("clusters") or []:
        if cluster.get("name") in names:
            cluster["type"] = "STATIC"
            cluster.pop("dns_lookup_family", None)
            cluster["load_assignment"] = _one_endpoint(cluster["name"], *xds)
    sockets = [((out.get("admin") or {}).get("address") or {}).get("socket_address")]
    for listener in (out.get("static_resources") or {}).get("listeners") or []:
        sockets.append((listener.get("address") or {}).get("socket_address"))
    for sock in sockets:
        if sock and sock.get("address") in _LOCAL_BINDS:
            sock["address"] = pod_ip
    return out


def _one_endpoint(name: str, host: str, port: int) -> Obj:
    address = {"socket_address": {"address": host, "port_value": port}}
    return {
        "cluster_name": name,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
    }


class PodRuntime:
    """Keeps one process per known container of every running pod in ``namespaces``."""

    def __init__(
        self,
        kube: KubeApi,
        workdir: Path,
        *,
        namespaces: Sequence[str],
        cli: Sequence[str],
        tokens: TokenSource,
        xds: tuple[str, int],
        interval: float = 0.5,
    ) -> None:
        self.kube = kube
        self.workdir = workdir
        self.namespaces = list(namespaces)
        self.cli = list(cli)
        self.tokens = tokens
        self.xds = xds
        self.interval = interval
        self.group = ProcessGroup()
        self.errors: list[str] = []
        self._running: dict[PodKey, list[ManagedProcess]] = {}
        self._held: set[str] = set()  # pods stopped on purpose: "namespace/name"
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
            except Exception as error:  # keep the kubelet alive; report at the end
                self.errors.append(f"sync failed: {error!r}")
                log.exception("pod runtime sync failed")

    def sync(self) -> None:
        """Start processes for new running pods, stop those of pods that went away."""
        with self._lock:
            live = {
                key: pod
                for key, pod in self._pods()
                if f"{key.namespace}/{key.name}" not in self._held
            }
            for key in [k for k in self._running if k not in live]:
                self._stop_pod(key)
            for key, pod in live.items():
                if key not in self._running:
                    self._running[key] = self._start_pod(key, pod)

    def _pods(self) -> Iterator[tuple[PodKey, Obj]]:
        for namespace in self.namespaces:
            for pod in self.kube.list("Pod", namespace):
                status = pod.get("status") or {}
                meta = pod["metadata"]
                if status.get("phase") != "Running" or not status.get("podIP"):
                    continue
                if meta.get("deletionTimestamp"):
                    continue
                yield PodKey(namespace, meta["name"], meta.get("uid", ""), status["podIP"]), pod

    def _start_pod(self, key: PodKey, pod: Obj) -> list[ManagedProcess]:
        folder = self.workdir / key.namespace / key.name
        folder.mkdir(parents=True, exist_ok=True)
        mounts = self._volumes(key.namespace, pod, folder)
        started = []
        for container in (pod.get("spec") or {}).get("containers") or []:
            kind = container_kind(str(container.get("image", "")))
            if kind is None:
                self.errors.append(
                    f"{key.name}/{container.get('name')}: no runtime for {container.get('image')}"
                )
                continue
            argv, env = self._command(kind, key, pod, container, mounts, folder)
            name = f"{kind}-{key.name}-{container.get('name')}"
            started.append(
                self.group.start(
                    name, argv, env=env, log_path=folder / f"{container.get('name')}.log"
                )
            )
        return started

    def _command(
        self,
        kind: str,
        key: PodKey,
        pod: Obj,
        container: Obj,
        mounts: Mapping[str, Path],
        folder: Path,
    ) -> tuple[list[str], dict[str, str]]:
        env = container_env(pod, container)
        args = [self._mounted(expand(str(a), env), mounts) for a in container.get("args") or []]
        base_env = dict(os.environ)
        if kind == "echo":
            return [sys.executable, str(ECHO_SERVER), "--host", key.ip, *args], {**base_env, **env}
        if kind == "epp":
            account = (pod.get("spec") or {}).get("serviceAccountName") or "default"
            kubeconfig = self.tokens(key.namespace, account)
            return [*self.cli, *args, "--host", key.ip], {
                **base_env,
                **env,
                "KUBECONFIG": str(kubeconfig),
            }
        return self._envoy_argv(key, args, folder), {**base_env, **env}

    def _envoy_argv(self, key: PodKey, args: list[str], folder: Path) -> list[str]:
        """Envoy on the pod's bootstrap as it would behave in the pod (see the module doc)."""
        out = list(args)
        for flag in ("-c", "--config-path"):
            if flag in out:
                source = Path(out[out.index(flag) + 1])
                bootstrap = yaml.safe_load(source.read_text())
                local = folder / "bootstrap.local.yaml"
                local.write_text(yaml.safe_dump(rewrite_bootstrap(bootstrap, key.ip, self.xds)))
                out[out.index(flag) + 1] = str(local)
        if "--disable-hot-restart" not in out:
            out.append("--disable-hot-restart")  # several "pods" share this machine's shm
        return [str(find_envoy()), *out]

    def _volumes(self, namespace: str, pod: Obj, folder: Path) -> dict[str, Path]:
        """ConfigMap volumes written to disk; mount path → local folder."""
        spec = pod.get("spec") or {}
        sources: dict[str, Path] = {}
        for volume in spec.get("volumes") or []:
            config_map = (volume.get("configMap") or {}).get("name")
            if not config_map:
                continue
            body = self.kube.get("ConfigMap", namespace, config_map) or {}
            target = folder / "volumes" / volume["name"]
            target.mkdir(parents=True, exist_ok=True)
            for file, text in (body.get("data") or {}).items():
                (target / file).write_text(text)
            sources[volume["name"]] = target
        mounts: dict[str, Path] = {}
        for container in spec.get("containers") or []:
            for mount in container.get("volumeMounts") or []:
                if mount.get("name") in sources:
                    mounts[mount["mountPath"].rstrip("/")] = sources[mount["name"]]
        return mounts

    @staticmethod
    def _mounted(arg: str, mounts: Mapping[str, Path]) -> str:
        for mount_path, local in sorted(mounts.items(), key=lambda item: -len(item[0])):
            if arg == mount_path or arg.startswith(mount_path + "/"):
                return str(local) + arg[len(mount_path) :]
        return arg

    def _stop_pod(self, key: PodKey) -> None:
        for process in self._running.pop(key, []):
            process.stop()
            if process in self.group.processes:
                self.group.processes.remove(process)

    def hold(self, namespace: str, name: str) -> None:
        """Stop a pod's processes and keep them stopped (the API still says Running)."""
        with self._lock:
            self._held.add(f"{namespace}/{name}")
            for key in [k for k in self._running if (k.namespace, k.name) == (namespace, name)]:
                self._stop_pod(key)

    def release(self, namespace: str, name: str) -> None:
        """Let a held pod run again (started on the next sync)."""
        with self._lock:
            self._held.discard(f"{namespace}/{name}")
        self.sync()

    def logs(self) -> Iterator[tuple[str, str]]:
        for process in list(self.group):
            yield process.name, process.log_tail(3000)
        if self.errors:
            yield "pod-runtime", "\n".join(self.errors[-20:])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.group.stop_all()
