"""kopf wiring: which watch events trigger a reconcile of which pool.

Thin on purpose: every handler only works out *which* pool to look at and calls
:func:`infergate.operator.reconcile.reconcile` in a worker thread, one pool at a
time. What the watches have seen lives in kopf's own indexes (``pool_refs``,
``objectives_by_pool``, ``rewrites_by_pool``); the client, settings and locks in kopf's
``memo``. kopf stores nothing on the pools (raw event handlers need no finalizers or
progress annotations), so the operator's writes are exactly what it applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import kopf

from infergate.operator import constants as c
from infergate.operator.kube import Kube
from infergate.operator.policy import POLICY_KINDS, reconcile_policy
from infergate.operator.reconcile import reconcile
from infergate.operator.settings import OperatorSettings

log = logging.getLogger("infergate.operator")


@dataclass(frozen=True)
class _PoolRefs:
    """What pod and Service events are matched against, per pool."""

    match_labels: dict[str, str]
    picker: str


@dataclass
class _Shared:
    """The operator's shared state, kept in kopf's ``memo`` (one per operator process)."""

    kube: Kube
    settings: OperatorSettings
    locks: dict[Any, asyncio.Lock] = field(default_factory=dict)
    pending: set[tuple[str, str]] = field(default_factory=set)
    resync: asyncio.Task[None] | None = None


def _shared(memo: kopf.Memo) -> _Shared:
    shared: _Shared = memo["infergate"]
    return shared


# -- kopf indexes: the pools and policy objects the watches have seen ---------------------


@kopf.index(c.POOL_GROUP, c.POOL_VERSION, c.POOL_PLURAL)
def pool_refs(namespace: str | None, name: str, spec: kopf.Spec, **_: Any) -> Any:
    """(namespace, name) -> the pool's selector labels and picker Service name."""
    return {
        (namespace or "default", name): _PoolRefs(
            match_labels=dict((spec.get("selector") or {}).get("matchLabels") or {}),
            picker=str((spec.get("endpointPickerRef") or {}).get("name") or ""),
        )
    }


def _policy_index(body: kopf.Body, namespace: str | None, name: str, spec: kopf.Spec) -> Any:
    kind = str(body.get("kind") or "")
    if kind not in POLICY_KINDS:
        return None
    return {
        (namespace or "default", str((spec.get("poolRef") or {}).get("name") or "")): (kind, name)
    }


@kopf.index(c.X_GROUP, c.X_VERSION, c.OBJECTIVE_PLURAL)
def objectives_by_pool(
    body: kopf.Body, namespace: str | None, name: str, spec: kopf.Spec, **_: Any
) -> Any:
    """(namespace, pool name) -> (kind, name) of each InferenceObjective naming it."""
    return _policy_index(body, namespace, name, spec)


@kopf.index(c.X_GROUP, c.X_VERSION, c.REWRITE_PLURAL)
def rewrites_by_pool(
    body: kopf.Body, namespace: str | None, name: str, spec: kopf.Spec, **_: Any
) -> Any:
    """(namespace, pool name) -> (kind, name) of each InferenceModelRewrite naming it."""
    return _policy_index(body, namespace, name, spec)


def _index(kwargs: dict[str, Any], name: str) -> kopf.Index[Any, Any]:
    """One of this module's kopf indexes, as kopf passes it to every handler."""
    index: kopf.Index[Any, Any] = kwargs[name]
    return index


def _policy_indexes(kwargs: dict[str, Any]) -> tuple[kopf.Index[Any, Any], ...]:
    return _index(kwargs, "objectives_by_pool"), _index(kwargs, "rewrites_by_pool")


# -- reconciling -------------------------------------------------------------------------


async def reconcile_pool(shared: _Shared, namespace: str | None, name: str, why: str) -> None:
    """Reconcile one pool; coalesce bursts (a pending run covers later triggers)."""
    namespace = namespace or "default"
    key = (namespace, name)
    if key in shared.pending:
        return
    shared.pending.add(key)
    lock = shared.locks.setdefault(key, asyncio.Lock())
    async with lock:
        shared.pending.discard(key)
        try:
            result = await asyncio.to_thread(
                reconcile, shared.kube, namespace, name, shared.settings
            )
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


async def reconcile_policy_object(shared: _Shared, kind: str, namespace: str, name: str) -> None:
    lock = shared.locks.setdefault((kind, namespace, name), asyncio.Lock())
    async with lock:
        try:
            await asyncio.to_thread(reconcile_policy, shared.kube, kind, namespace, name)
        except Exception as error:  # retried by the next event or resync
            log.warning("status of %s %s/%s failed: %s", kind, namespace, name, error)


async def _policies_of(
    shared: _Shared, namespace: str, pool: str, *indexes: kopf.Index[Any, Any]
) -> None:
    """A pool came or went: the objectives and rewrites naming it re-check their status."""
    for index in indexes:
        for kind, name in list(index.get((namespace, pool), [])):
            await reconcile_policy_object(shared, kind, namespace, name)


# -- kopf handlers -----------------------------------------------------------------------


@kopf.on.startup()
async def configure(
    settings: kopf.OperatorSettings,
    memo: kopf.Memo,
    **kwargs: Any,
) -> None:
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
    shared = _Shared(kube=Kube(), settings=OperatorSettings.from_env())
    memo["infergate"] = shared
    shared.resync = asyncio.create_task(
        _resync_forever(shared, _index(kwargs, "pool_refs"), *_policy_indexes(kwargs))
    )


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    shared: _Shared | None = memo.get("infergate")
    if shared is not None and shared.resync is not None:
        shared.resync.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await shared.resync


@kopf.on.event(c.POOL_GROUP, c.POOL_VERSION, c.POOL_PLURAL)
async def pool_event(
    event: kopf.RawEvent,
    namespace: str | None,
    name: str,
    memo: kopf.Memo,
    **kwargs: Any,
) -> None:
    shared = _shared(memo)
    key = (namespace or "default", name)
    if event.get("type") == "DELETED":
        shared.locks.pop(key, None)
        await _policies_of(shared, *key, *_policy_indexes(kwargs))
        return  # garbage collection removes the owned objects
    await reconcile_pool(shared, namespace, name, f"pool {event.get('type') or 'listed'}")
    if event.get("type") == "ADDED" or event.get("type") is None:
        await _policies_of(shared, *key, *_policy_indexes(kwargs))


@kopf.on.event("apps", "v1", "deployments", labels={c.LABEL_MANAGED_BY: "infergate-operator"})
async def owned_deployment_event(
    event: kopf.RawEvent,
    namespace: str | None,
    labels: kopf.Labels,
    memo: kopf.Memo,
    **kwargs: Any,
) -> None:
    pool = labels.get(c.LABEL_POOL)
    if pool and (namespace, pool) in _index(kwargs, "pool_refs"):
        await reconcile_pool(_shared(memo), namespace, pool, f"deployment {event.get('type')}")


@kopf.on.event("", "v1", "services")
async def service_event(
    event: kopf.RawEvent,
    namespace: str | None,
    name: str,
    memo: kopf.Memo,
    **kwargs: Any,
) -> None:
    """Our Service changed, or a Service a pool refers to came or went (own picker)."""
    for (pool_ns, pool_name), refs in list(_index(kwargs, "pool_refs").items()):
        if pool_ns == namespace and any(r.picker == name for r in refs):
            await reconcile_pool(
                _shared(memo), namespace, pool_name, f"service {event.get('type')}"
            )


@kopf.on.event("", "v1", "pods")
async def pod_event(
    event: kopf.RawEvent,
    namespace: str | None,
    labels: kopf.Labels,
    memo: kopf.Memo,
    **kwargs: Any,
) -> None:
    """A model-server pod changed: pools whose selector matches it update their counts."""
    for (pool_ns, pool_name), refs in list(_index(kwargs, "pool_refs").items()):
        if pool_ns != namespace:
            continue
        for ref in refs:
            if ref.match_labels and all(labels.get(k) == v for k, v in ref.match_labels.items()):
                await reconcile_pool(
                    _shared(memo), namespace, pool_name, f"pod {event.get('type')}"
                )
                break


@kopf.on.event(c.X_GROUP, c.X_VERSION, c.OBJECTIVE_PLURAL)
@kopf.on.event(c.X_GROUP, c.X_VERSION, c.REWRITE_PLURAL)
async def policy_event(
    event: kopf.RawEvent, namespace: str | None, name: str, memo: kopf.Memo, **_: Any
) -> None:
    obj = event.get("object") or {}
    kind = str(obj.get("kind") or "")
    if kind not in POLICY_KINDS or event.get("type") == "DELETED":
        return
    await reconcile_policy_object(_shared(memo), kind, namespace or "default", name)


async def _resync_forever(
    shared: _Shared,
    pools: kopf.Index[Any, Any],
    *policy_indexes: kopf.Index[Any, Any],
) -> None:
    """Full resync every ``resync_seconds``: status follows the world without events."""
    while True:
        await asyncio.sleep(shared.settings.resync_seconds)
        for namespace, name in list(pools):
            await reconcile_pool(shared, namespace, name, "resync")
        for index in policy_indexes:
            for (namespace, _pool), entries in list(index.items()):
                for kind, name in list(entries):
                    await reconcile_policy_object(shared, kind, namespace, name)
