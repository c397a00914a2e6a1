"""kopf wiring: which watch events trigger a reconcile of which pool.

Thin on purpose: every handler only works out *which* pool to look at and calls
:func:`infergate.operator.reconcile.reconcile` in a worker thread, one pool at a
time. kopf stores nothing on the pools (raw event handlers need no finalizers or
progress annotations), so the operator's writes are exactly what it applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import kopf

from infergate.operator import constants as c
from infergate.operator.kube import Kube
from infergate.operator.policy import POLICY_KINDS, reconcile_policy
from infergate.operator.reconcile import reconcile
from infergate.operator.settings import OperatorSettings

log = logging.getLogger("infergate.operator")

_state: dict[str, Any] = {}
_locks: dict[tuple[str, str], asyncio.Lock] = {}
_pending: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class _PoolRefs:
    match_labels: dict[str, str]
    picker: str


#: Pools seen on the watch: what pod and Service events are matched against.
_pools: dict[tuple[str, str], _PoolRefs] = {}


def _kube() -> Kube:
    kube = _state.get("kube")
    if kube is None:
        kube = _state["kube"] = Kube()
    return kube


def _settings() -> OperatorSettings:
    settings = _state.get("settings")
    if settings is None:
        settings = _state["settings"] = OperatorSettings.from_env()
    return settings


async def reconcile_pool(namespace: str | None, name: str, why: str) -> None:
    """Reconcile one pool; coalesce bursts (a pending run covers later triggers)."""
    namespace = namespace or "default"
    key = (namespace, name)
    if key in _pending:
        return
    _pending.add(key)
    lock = _locks.setdefault(key, asyncio.Lock())
    async with lock:
        _pending.discard(key)
        try:
            result = await asyncio.to_thread(reconcile, _kube(), namespace, name, _settings())
        except Exception as error:  # a failed pass is retried by the next trigger or resync
            log.warning(
                "reconcile of %s/%s failed (%s): %s", namespace, name, why, error,
                extra={"pool": name, "namespace": namespace, "trigger": why, "error": str(error)},
            )  # fmt: skip
            return
    if result.applied or result.deleted or result.status_written:
        conditions = {cond.type: f"{cond.status}/{cond.reason}" for cond in result.conditions}
        # JSON logs carry the extras as fields: pool, applied, deleted, conditions, ...
        log.info(
            "reconciled %s/%s (%s): applied=%s deleted=%s status_written=%s conditions=%s",
            namespace, name, why, result.applied, result.deleted, result.status_written, conditions,
            extra={
                "pool": name, "namespace": namespace, "trigger": why, "applied": result.applied,
                "deleted": result.deleted, "status_written": result.status_written,
                "conditions": conditions, "ready_endpoints": result.ready_endpoints,
            },
        )  # fmt: skip


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Only our own, explicit Events (no log-line-per-event bridge) and no kopf state
    # on the pools: the operator's writes stay exactly what it decides to write.
    settings.posting.enabled = False
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="infergate.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="infergate.io")
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 30
    # kopf logs every handled watch event at INFO; keep our own, meaningful lines instead.
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    _settings()
    _state["resync"] = asyncio.create_task(_resync_forever())


@kopf.on.cleanup()
async def stop_resync(**_: Any) -> None:
    task = _state.pop("resync", None)
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@kopf.on.event(c.POOL_GROUP, c.POOL_VERSION, c.POOL_PLURAL)
async def pool_event(
    event: kopf.RawEvent, namespace: str | None, name: str, spec: kopf.Spec, **_: Any
) -> None:
    key = (namespace or "default", name)
    if event.get("type") == "DELETED":
        _pools.pop(key, None)
        _locks.pop(key, None)
        await _policies_of(*key)
        return  # garbage collection removes the owned objects
    _pools[key] = _PoolRefs(
        match_labels=dict((spec.get("selector") or {}).get("matchLabels") or {}),
        picker=str((spec.get("endpointPickerRef") or {}).get("name") or ""),
    )
    await reconcile_pool(namespace, name, f"pool {event.get('type') or 'listed'}")
    if event.get("type") == "ADDED" or event.get("type") is None:
        await _policies_of(*key)


@kopf.on.event("apps", "v1", "deployments", labels={c.LABEL_MANAGED_BY: "infergate-operator"})
async def owned_deployment_event(
    event: kopf.RawEvent, namespace: str | None, labels: kopf.Labels, **_: Any
) -> None:
    pool = labels.get(c.LABEL_POOL)
    if pool and (namespace, pool) in _pools:
        await reconcile_pool(namespace, pool, f"deployment {event.get('type')}")


@kopf.on.event("", "v1", "services")
async def service_event(event: kopf.RawEvent, namespace: str | None, name: str, **_: Any) -> None:
    """Our Service changed, or a Service a pool refers to came or went (own picker)."""
    for (pool_ns, pool_name), refs in list(_pools.items()):
        if pool_ns == namespace and refs.picker == name:
            await reconcile_pool(namespace, pool_name, f"service {event.get('type')}")


@kopf.on.event("", "v1", "pods")
async def pod_event(
    event: kopf.RawEvent, namespace: str | None, labels: kopf.Labels, **_: Any
) -> None:
    """A model-server pod changed: pools whose selector matches it update their counts."""
    for (pool_ns, pool_name), refs in list(_pools.items()):
        if pool_ns != namespace or not refs.match_labels:
            continue
        if all(labels.get(k) == v for k, v in refs.match_labels.items()):
            await reconcile_pool(namespace, pool_name, f"pod {event.get('type')}")


#: Policy objects seen on the watch: (kind, namespace, name) -> the pool they name.
_policies: dict[tuple[str, str, str], str] = {}
_policy_locks: dict[tuple[str, str, str], asyncio.Lock] = {}


async def reconcile_policy_object(kind: str, namespace: str, name: str) -> None:
    lock = _policy_locks.setdefault((kind, namespace, name), asyncio.Lock())
    async with lock:
        try:
            await asyncio.to_thread(reconcile_policy, _kube(), kind, namespace, name)
        except Exception as error:  # retried by the next event or resync
            log.warning("status of %s %s/%s failed: %s", kind, namespace, name, error)


@kopf.on.event(c.X_GROUP, c.X_VERSION, c.OBJECTIVE_PLURAL)
@kopf.on.event(c.X_GROUP, c.X_VERSION, c.REWRITE_PLURAL)
async def policy_event(
    event: kopf.RawEvent, namespace: str | None, name: str, spec: kopf.Spec, **_: Any
) -> None:
    obj = event.get("object") or {}
    kind = str(obj.get("kind") or "")
    if kind not in POLICY_KINDS:
        return
    key = (kind, namespace or "default", name)
    if event.get("type") == "DELETED":
        _policies.pop(key, None)
        return
    _policies[key] = str((spec.get("poolRef") or {}).get("name") or "")
    await reconcile_policy_object(*key)


async def _policies_of(namespace: str, pool: str) -> None:
    """A pool came or went: the objectives and rewrites naming it re-check their status."""
    for (kind, ns, name), target in list(_policies.items()):
        if ns == namespace and target == pool:
            await reconcile_policy_object(kind, ns, name)


async def _resync_forever() -> None:
    """Full resync every ``resync_seconds``: status follows the world without events."""
    while True:
        await asyncio.sleep(_settings().resync_seconds)
        for namespace, name in list(_pools):
            await reconcile_pool(namespace, name, "resync")
        for kind, namespace, name in list(_policies):
            await reconcile_policy_object(kind, namespace, name)
