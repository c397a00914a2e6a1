"""Kubernetes discovery (pool mode): the InferencePool, its ready Pods, objectives, rewrites.

Four list+watch loops run in threads with the official ``kubernetes`` client (its watch is
synchronous) and hand every change to the event loop, where all state lives:

* the ``InferencePool`` (``inference.networking.k8s.io/v1``) named by ``--pool-name``:
  its ``selector.matchLabels`` and ``targetPorts``;
* the namespace's Pods: each Ready pod with an IP, not being deleted, whose labels match
  the selector gives one endpoint per target port (labels carried, so the
  ``inference.networking.k8s.io/engine-type`` label picks the metrics dialect);
* ``InferenceObjective`` and ``InferenceModelRewrite`` (``inference.networking.x-k8s.io/
  v1alpha2``) whose ``poolRef`` names this pool.

A watch that expires (410 Gone) or fails is re-listed after a short back-off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from infergate.epp.datalayer.datastore import Datastore
from infergate.epp.datalayer.objectives import ObjectivesError, ObjectiveStore, parse_object
from infergate.epp.types import Endpoint

log = logging.getLogger("infergate.epp.kube")

POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
X_GROUP, X_VERSION = "inference.networking.x-k8s.io", "v1alpha2"
WATCH_TIMEOUT = 30
READ_TIMEOUT = 3


def pod_ready(pod: dict[str, Any]) -> bool:
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def pool_endpoints(pool: dict[str, Any] | None, pods: dict[str, dict[str, Any]]) -> list[Endpoint]:
    """The endpoints a pool selects: ready matching pods × target ports."""
    if not pool:
        return []
    spec = pool.get("spec") or {}
    selector = spec.get("selector") or {}
    match = selector.get("matchLabels", selector) if isinstance(selector, dict) else {}
    ports = [int(p["number"]) for p in spec.get("targetPorts") or [] if "number" in p]
    if not match or not ports:
        return []
    out: list[Endpoint] = []
    for pod in pods.values():
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if not pod_ready(pod) or any(labels.get(k) != v for k, v in match.items()):
            continue
        ip = pod["status"]["podIP"]
        label_items = tuple(sorted((str(k), str(v)) for k, v in labels.items()))
        out.extend(Endpoint(ip, port, label_items) for port in ports)
    return out


class KubeDiscovery:
    def __init__(
        self,
        pool_name: str,
        namespace: str,
        datastore: Datastore,
        objectives: ObjectiveStore,
    ) -> None:
        self.pool_name = pool_name
        self.namespace = namespace
        self.datastore = datastore
        self.objectives = objectives
        self.pool: dict[str, Any] | None = None
        self.pods: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.synced = asyncio.Event()
        self._synced_parts: set[str] = set()

    async def start(self) -> None:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            # KUBECONFIG read now: the client's own default is frozen at its import.
            path = os.environ.get("KUBECONFIG") or None
            await asyncio.to_thread(config.load_kube_config, config_file=path)
        api = client.ApiClient()
        core = client.CoreV1Api(api)
        custom = client.CustomObjectsApi(api)
        self._serialize = api.sanitize_for_serialization
        self._loop = asyncio.get_running_loop()
        ns = self.namespace
        watches: list[tuple[str, Callable[..., Any], dict[str, Any]]] = [
            (
                "pool",
                custom.list_namespaced_custom_object,
                {
                    "group": POOL_GROUP,
                    "version": POOL_VERSION,
                    "namespace": ns,
                    "plural": POOL_PLURAL,
                    "field_selector": f"metadata.name={self.pool_name}",
                },
            ),
            ("pods", core.list_namespaced_pod, {"namespace": ns}),
            (
                "objectives",
                custom.list_namespaced_custom_object,
                {
                    "group": X_GROUP,
                    "version": X_VERSION,
                    "namespace": ns,
                    "plural": "inferenceobjectives",
                },
            ),
            (
                "rewrites",
                custom.list_namespaced_custom_object,
                {
                    "group": X_GROUP,
                    "version": X_VERSION,
                    "namespace": ns,
                    "plural": "inferencemodelrewrites",
                },
            ),
        ]
        for part, lister, kwargs in watches:
            thread = threading.Thread(
                target=self._run, args=(part, lister, kwargs), name=f"kube-{part}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(
            *(asyncio.to_thread(thread.join, READ_TIMEOUT + 5) for thread in self._threads)
        )

    # ------------------------------------------------------------------ threads

    def _run(self, part: str, lister: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        backoff = 0.5
        version: str | None = None
        while not self._stop.is_set():
            try:
                if version is None:  # (re)list, then watch from the list's version
                    listing = self._serialize(lister(**kwargs))
                    items = [self._serialize(i) for i in listing.get("items") or []]
                    self._post(self._reset, part, items)
                    version = (listing.get("metadata") or {}).get("resourceVersion") or ""
                stream = watch.Watch()
                # A short client-side read timeout bounds how long shutdown waits; an idle
                # watch is simply re-opened from the same resourceVersion (no re-list).
                for event in stream.stream(
                    lister,
                    resource_version=version,
                    timeout_seconds=WATCH_TIMEOUT,
                    _request_timeout=(5, READ_TIMEOUT),
                    **kwargs,
                ):
                    if self._stop.is_set():
                        stream.stop()
                        break
                    if event.get("type") == "ERROR":
                        version = None  # 410 Gone and friends: start over
                        break
                    obj = self._serialize(event.get("object"))
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    self._post(self._event, part, event.get("type"), obj)
                backoff = 0.5
            except ApiException as error:
                if error.status == 404 and part in ("objectives", "rewrites"):
                    log.info("no %s API in this cluster; not watching it", part)
                    return
                if error.status != 410:
                    log.warning("watching %s failed (%s); retrying", part, error.status)
                version = None
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10)
            except Exception as error:
                if self._stop.is_set():
                    return
                if "timed out" in str(error).lower():
                    continue  # idle watch: re-open it
                log.warning("watching %s failed: %s; retrying", part, error)
                version = None
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop closed during shutdown
                self._loop.call_soon_threadsafe(fn, *args)

    # --------------------------------------------------------------- loop side

    def _reset(self, part: str, items: list[dict[str, Any]]) -> None:
        if part == "pool":
            self.pool = items[0] if items else None
        elif part == "pods":
            self.pods = {i["metadata"]["name"]: i for i in items}
        else:
            kind = "InferenceObjective" if part == "objectives" else "InferenceModelRewrite"
            current = (
                self.objectives.objectives if part == "objectives" else self.objectives.rewrites
            )
            current.clear()
            for item in items:
                self._upsert(kind, item)
        self._synced_parts.add(part)
        if {"pool", "pods"} <= self._synced_parts:
            self.synced.set()
        self._recompute()

    def _event(self, part: str, kind: str, obj: dict[str, Any]) -> None:
        name = (obj.get("metadata") or {}).get("name", "")
        if part == "pool":
            if name == self.pool_name:
                self.pool = None if kind == "DELETED" else obj
        elif part == "pods":
            if kind == "DELETED":
                self.pods.pop(name, None)
            else:
                self.pods[name] = obj
        else:
            k = "InferenceObjective" if part == "objectives" else "InferenceModelRewrite"
            if kind == "DELETED":
                self.objectives.delete(k, name)
            else:
                self._upsert(k, obj)
        self._recompute()

    def _upsert(self, kind: str, obj: dict[str, Any]) -> None:
        try:
            self.objectives.upsert(parse_object({**obj, "kind": kind}))
        except ObjectivesError as error:
            log.warning("ignoring %s: %s", kind, error)

    def _recompute(self) -> None:
        if {"pool", "pods"} <= self._synced_parts:
            self.datastore.set_endpoints(pool_endpoints(self.pool, self.pods))
