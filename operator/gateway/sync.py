"""One translation made real in the cluster: each Gateway's proxy objects applied (only
what changed), proxies no Gateway wants pruned, and statuses written (only what changed).

Synchronous on purpose, like :mod:`infergate.operator.reconcile` (the ``kubernetes``
client is); the reconcile loop runs :meth:`GatewaySync.sync` in a worker thread, one at a
time. Status writes are guarded by ``resourceVersion``: a 409 means someone else wrote
meanwhile, and the loop simply runs again on the watch event that write caused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from infergate.gateway.types import GATEWAY_GROUP, ClusterObjects, Key, Translation
from infergate.operator import constants as c
from infergate.operator.gateway import status as gs
from infergate.operator.gateway.objects import (
    GATEWAY_KIND,
    PROXY_KINDS,
    ProxyConfig,
    desired_objects,
    owned_by,
    proxy_name,
)
from infergate.operator.kube import KINDS, Kind, Kube, KubeError
from infergate.operator.reconcile import is_up_to_date
from infergate.operator.settings import GatewaySettings, OperatorSettings
from infergate.operator.status import now_rfc3339

Obj = dict[str, Any]
#: (kind, namespace, name) of a proxy object.
ProxyKey = tuple[str, str, str]
log = logging.getLogger("infergate.operator.gateway")

GATEWAY_KINDS: dict[str, Kind] = {
    **KINDS,
    "GatewayClass": Kind(GATEWAY_GROUP, "v1", "gatewayclasses", namespaced=False),
    "Gateway": Kind(GATEWAY_GROUP, "v1", "gateways"),
    "HTTPRoute": Kind(GATEWAY_GROUP, "v1", "httproutes"),
    # v1beta1: served by every Gateway API release that has ReferenceGrant at all.
    "ReferenceGrant": Kind(GATEWAY_GROUP, "v1beta1", "referencegrants"),
}


class GatewayKube(Kube):
    """The operator's client, knowing the Gateway API kinds too."""

    kinds = GATEWAY_KINDS


def key_of(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


@dataclass
class SyncResult:
    """What one pass did (for logs and tests); ``retry`` asks the loop to run again."""

    applied: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    #: Proxies that could not be applied (the API server's answer); retried on the next
    #: pass when the error is transient, else on the next change or resync.
    errors: list[str] = field(default_factory=list)
    retry: bool = False

    def __bool__(self) -> bool:
        return bool(self.applied or self.deleted or self.statuses or self.conflicts or self.errors)


@dataclass
class GatewaySync:
    """Applies translations. Remembers what it last wrote, so a pass that runs before the
    watch shows its own previous write does not write (and conflict) again."""

    kube: Kube
    settings: GatewaySettings
    operator_settings: OperatorSettings
    proxy_config: Callable[[Obj], ProxyConfig]
    #: (kind, namespace, name) -> (resourceVersion we wrote over, status we wrote).
    _written: dict[tuple[str, str, str], tuple[str, Any]] = field(default_factory=dict)
    #: (namespace, name) of a proxy ConfigMap -> the spec hash applied (they are not watched).
    _config_maps: dict[Key, str] = field(default_factory=dict)
    #: (kind, namespace, name) -> (resourceVersion we applied over, spec hash applied).
    _applied: dict[ProxyKey, tuple[str, str]] = field(default_factory=dict)

    def forget(self) -> None:
        """Drop the caches: the next pass re-reads what it cannot see in the indexes."""
        self._written.clear()
        self._config_maps.clear()
        self._applied.clear()

    def sync(
        self,
        objects: ClusterObjects,
        translation: Translation,
        proxies: Mapping[ProxyKey, Obj],
    ) -> SyncResult:
        """Make the cluster match ``translation``. ``proxies``: the live proxy Deployments
        and Services the watches have seen, by (kind, namespace, name)."""
        result = SyncResult()
        gateways = {key_of(g): g for g in objects.gateways}
        for key in sorted(translation.snapshots):
            if key not in gateways:
                continue
            try:
                self._apply_proxy(gateways[key], proxies, result)
            except KubeError as error:  # one Gateway's proxy must not hold up the others
                result.errors.append(f"Gateway {key[0]}/{key[1]}: {error}")
                result.retry = result.retry or error.status in (409, 429) or error.status >= 500
        self._prune(translation, gateways, proxies, result)
        self._write_statuses(objects, translation, result)
        return result

    # -- proxy objects ------------------------------------------------------------------

    def _apply_proxy(
        self, gateway: Obj, proxies: Mapping[ProxyKey, Obj], result: SyncResult
    ) -> None:
        namespace = key_of(gateway)[0]
        uid = str(gateway["metadata"].get("uid") or "")
        desired = desired_objects(
            gateway, self.proxy_config(gateway), self.operator_settings,
            self.settings.service_type,
        )  # fmt: skip
        for obj in desired:
            kind, obj_name = obj["kind"], obj["metadata"]["name"]
            live = self._live(kind, namespace, obj_name, obj, proxies)
            if live is not None and not owned_by(live, uid):
                result.conflicts.append(f"{kind} {namespace}/{obj_name}")
                continue  # someone else's object: never taken over
            if live is not None and is_up_to_date(live, obj):
                self._applied.pop((kind, namespace, obj_name), None)
                continue
            if self._applied.get((kind, namespace, obj_name)) == (_version(live), _hash(obj)):
                continue  # our apply of exactly this is on its way through the watch
            self.kube.apply(obj)
            result.applied.append(f"{kind} {namespace}/{obj_name}")
            self._applied[(kind, namespace, obj_name)] = (_version(live), _hash(obj))
            if kind == "ConfigMap":
                self._config_maps[(namespace, obj_name)] = _hash(obj)

    def _live(
        self, kind: str, namespace: str, name: str, desired: Obj, proxies: Mapping[ProxyKey, Obj]
    ) -> Obj | None:
        """The live object from the watches; ConfigMaps are not watched (the operator would
        have to read every ConfigMap of the cluster), so they are read when not known."""
        if kind != "ConfigMap":
            return proxies.get((kind, namespace, name))
        if self._config_maps.get((namespace, name)) == _hash(desired):
            return desired
        return self.kube.get("ConfigMap", namespace, name)

    def _prune(
        self,
        translation: Translation,
        gateways: Mapping[Key, Obj],
        proxies: Mapping[ProxyKey, Obj],
        result: SyncResult,
    ) -> None:
        """Delete the proxy of a Gateway that still exists but is no longer ours to serve
        (its class changed, or it is not accepted); a deleted Gateway's proxy goes by
        garbage collection."""
        by_uid = {str(g["metadata"].get("uid")): key for key, g in gateways.items()}
        serving = {uid for uid, key in by_uid.items() if key in translation.snapshots}
        stale: set[tuple[Key, str]] = set()
        for live in proxies.values():
            for ref in (live.get("metadata") or {}).get("ownerReferences") or []:
                uid = str(ref.get("uid"))
                if ref.get("kind") == GATEWAY_KIND and uid in by_uid and uid not in serving:
                    stale.add((by_uid[uid], uid))
        for (namespace, name), uid in sorted(stale):
            self._delete_proxy(namespace, proxy_name(name), uid, result)

    def _delete_proxy(self, namespace: str, name: str, uid: str, result: SyncResult) -> None:
        for kind in PROXY_KINDS:
            live = self.kube.get(kind, namespace, name)
            if live is None or not owned_by(live, uid):
                continue
            if self.kube.delete(kind, namespace, name, uid=live["metadata"].get("uid")):
                result.deleted.append(f"{kind} {namespace}/{name}")
        self._config_maps.pop((namespace, name), None)

    # -- statuses -----------------------------------------------------------------------

    def _write_statuses(
        self, objects: ClusterObjects, translation: Translation, result: SyncResult
    ) -> None:
        now = now_rfc3339()
        for gwc in objects.gateway_classes:
            name = key_of(gwc)[1]
            if name in translation.gateway_class_status:
                live = gwc.get("status") or {}
                want = gs.stamp_gateway_status(translation.gateway_class_status[name], live, now)
                self._write("GatewayClass", gwc, gs.status_patch(want, live), want, result)
        for gateway in objects.gateways:
            key = key_of(gateway)
            if key in translation.gateway_status:
                live = gateway.get("status") or {}
                want = gs.stamp_gateway_status(translation.gateway_status[key], live, now)
                self._write("Gateway", gateway, gs.status_patch(want, live), want, result)
        for route in objects.http_routes:
            self._write_parents("HTTPRoute", route, translation.route_parents, now, result)
        for pool in objects.inference_pools:
            self._write_parents(c.POOL_KIND, pool, translation.pool_parents, now, result)

    def _write_parents(
        self,
        kind: str,
        obj: Obj,
        wanted: Mapping[Key, list[Obj]],
        now: str,
        result: SyncResult,
    ) -> None:
        namespace, _ = key = key_of(obj)
        live = (obj.get("status") or {}).get("parents") or []
        ours = wanted.get(key, [])
        if not ours and not any(gs.is_ours(e) for e in live):
            return  # neither ours before nor now: nothing to say
        parents = gs.merge_parents(live, ours, namespace, now)
        self._write(kind, obj, {"parents": parents}, {"parents": parents}, result)

    def _write(self, kind: str, obj: Obj, patch: Obj, want: Obj, result: SyncResult) -> None:
        meta = obj.get("metadata") or {}
        namespace, name = key_of(obj)
        live = obj.get("status") or {}
        version = str(meta.get("resourceVersion") or "")
        if gs.unchanged(want, live) and _same_length(want, live):
            return
        memo_key = (kind, namespace, name)
        if self._written.get(memo_key) == (version, _timeless(want)):
            return  # our write of exactly this is on its way through the watch
        try:
            self.kube.patch_status(kind, namespace, name, patch, resource_version=version)
        except KubeError as error:
            if error.status in (404, 409):  # gone, or written meanwhile: the watch says
                result.conflicts.append(f"{kind} {namespace}/{name} ({error.status})")
                result.retry = result.retry or error.status == 409
            elif 400 <= error.status < 500 and error.status != 429:
                result.errors.append(f"status of {kind} {namespace}/{name}: {error}")
            else:
                raise  # the API server is struggling: the whole pass is retried
            return
        self._written[memo_key] = (version, _timeless(want))
        result.statuses.append(f"{kind} {namespace}/{name}")


def _same_length(want: Obj, live: Obj) -> bool:
    """``unchanged`` ignores fields only the live status has; a top-level field we no
    longer report (say ``addresses``) is a change."""
    return all(key in want for key in live)


def _timeless(value: Any) -> Any:
    """``value`` without ``lastTransitionTime``s: a pass in the next second stamps "now"
    again on conditions the stale view does not have yet; that is not a new status."""
    if isinstance(value, dict):
        return {k: _timeless(v) for k, v in value.items() if k != "lastTransitionTime"}
    if isinstance(value, list):
        return [_timeless(v) for v in value]
    return value


def _version(obj: Obj | None) -> str:
    return str(((obj or {}).get("metadata") or {}).get("resourceVersion") or "")


def _hash(obj: Obj) -> str:
    return str(obj["metadata"]["annotations"][c.ANNOTATION_SPEC_HASH])
