"""One reconcile of one pool: compare desired and live objects, apply only differences,
prune what is no longer wanted, and write status only when it changed.

Synchronous on purpose (the ``kubernetes`` client is); the kopf handlers run it in a
worker thread, one pool at a time.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from infergate.epp.config import pd_config
from infergate.epp.server.tls import mutual_tls_bundle

from infergate.operator import constants as c
from infergate.operator import status as st
from infergate.operator.builders import (
    build_tls_secret,
    desired_objects,
    encode_tls_bundle,
    tls_secret_name,
    tls_server_names,
)
from infergate.operator.eppconfig import DEFAULT_EPP_CONFIG, InvalidEPPConfig, check_epp_config
from infergate.operator.kube import KINDS, OWNED_KINDS, Kube, KubeError
from infergate.operator.pool import InvalidPool, PoolSpec, parse_pool
from infergate.operator.settings import OperatorSettings

Obj = dict[str, Any]
log = logging.getLogger("infergate.operator")


@dataclass
class Result:
    """What one reconcile did (for logs and tests)."""

    found: bool = True
    applied: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    status_written: bool = False
    ready_endpoints: int | None = None
    conditions: list[st.Condition] = field(default_factory=list)


class _NotAccepted(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def is_subset(want: Any, have: Any) -> bool:
    """True if every field of ``want`` is in ``have`` with the same value (lists: pairwise)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(
            k in have and is_subset(v, have[k]) for k, v in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(want) == len(have)
            and all(is_subset(w, h) for w, h in zip(want, have, strict=True))
        )
    return bool(want == have)


def is_up_to_date(live: Obj | None, desired: Obj) -> bool:
    """Applied before (same spec hash) and nobody changed our fields since (no drift)."""
    if live is None:
        return False
    want_hash = desired["metadata"]["annotations"][c.ANNOTATION_SPEC_HASH]
    have_hash = ((live.get("metadata") or {}).get("annotations") or {}).get(c.ANNOTATION_SPEC_HASH)
    return want_hash == have_hash and is_subset(desired, live)


def is_owned_by(obj: Obj, pool_uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == pool_uid for ref in refs)


def _pod_ready(pod: Obj) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    return any(
        cond.get("type") == "Ready" and cond.get("status") == "True"
        for cond in status.get("conditions") or []
    )


def count_ready_endpoints(kube: Kube, pool: PoolSpec) -> tuple[int, int]:
    """(ready, total) pods the pool's selector matches."""
    pods = kube.list("Pod", pool.namespace, pool.match_labels)
    return sum(1 for p in pods if _pod_ready(p)), len(pods)


def resolve_epp_config(kube: Kube, pool: PoolSpec) -> str:
    if pool.pd_threshold is not None:
        return pd_config(pool.pd_threshold)
    if pool.epp_config_ref is None:
        return DEFAULT_EPP_CONFIG
    source = f"ConfigMap {pool.namespace}/{pool.epp_config_ref}"
    config_map = kube.get("ConfigMap", pool.namespace, pool.epp_config_ref)
    if config_map is None:
        raise _NotAccepted("EndpointPickerConfigNotFound", f"{source} does not exist")
    text = (config_map.get("data") or {}).get(pool.epp_config_key)
    if text is None:
        raise _NotAccepted(
            "EndpointPickerConfigNotFound", f"{source} has no key {pool.epp_config_key!r}"
        )
    try:
        check_epp_config(text, f"{source} key {pool.epp_config_key}")
    except InvalidEPPConfig as error:
        raise _NotAccepted("InvalidEndpointPickerConfig", str(error)) from error
    return str(text)


def _tls_secret_in_use(pool: PoolSpec, live_deployment: Obj | None) -> bool:
    """Whether this pool's own EPP Deployment already mounts its TLS Secret: then the
    Secret was created before (by this process or an earlier one), without reading it."""
    if live_deployment is None or not is_owned_by(live_deployment, pool.uid):
        return False
    template = (live_deployment.get("spec") or {}).get("template") or {}
    volumes = (template.get("spec") or {}).get("volumes") or []
    name = tls_secret_name(pool)
    return any((v.get("secret") or {}).get("secretName") == name for v in volumes)


def ensure_tls_secret(kube: Kube, pool: PoolSpec, live_deployment: Obj | None) -> bool:
    """Create the pool's TLS Secret (one CA, the EPP's server pair, the standalone
    Envoy's client pair) unless it exists; whether the pods can mount it.

    Create-only (POST; 409 means it is there): the operator's RBAC may create Secrets but
    never read them, so certificates are issued once per pool and no other Secret is
    readable to it. Once the pool's Deployment mounts the Secret, resyncs and a restarted
    operator neither issue certificates again nor POST (a settled pool sees no write).
    Refused (an older chart's RBAC): the EPP keeps its self-signed certificate, and a
    warning says why.
    """
    if _tls_secret_in_use(pool, live_deployment):
        return True
    bundle = mutual_tls_bundle(server_names=tls_server_names(pool))
    secret = build_tls_secret(pool, encode_tls_bundle(bundle))
    try:
        kube.call("POST", KINDS["Secret"].path(pool.namespace), body=secret)
    except KubeError as error:
        if error.status == 409:
            return True
        log.warning(
            "pool %s/%s: cannot create Secret %s (HTTP %s); the EPP serves a self-signed "
            "certificate without client verification",
            pool.namespace, pool.name, tls_secret_name(pool), error.status,
        )  # fmt: skip
        return False
    return True


def prune(kube: Kube, pool: PoolSpec, keep: set[tuple[str, str]], result: Result) -> None:
    """Delete objects this pool owns that the desired set no longer has."""
    for kind in OWNED_KINDS:
        for obj in kube.list(kind, pool.namespace, {c.LABEL_POOL: pool.name}):
            meta = obj.get("metadata") or {}
            if (kind, meta.get("name")) in keep or not is_owned_by(obj, pool.uid):
                continue
            if kube.delete(kind, pool.namespace, meta["name"], uid=meta.get("uid")):
                result.deleted.append(f"{kind}/{meta['name']}")


def _not_accepted(reason: str, message: str) -> list[st.Condition]:
    return [
        st.false(c.ACCEPTED, reason, message),
        st.unknown(
            c.RESOLVED_REFS,
            "Pending",
            "references are not resolved for a pool that is not accepted",
        ),
        st.false(
            c.READY,
            "NotAccepted",
            "the pool is not accepted; an Endpoint Picker deployed for an earlier, valid spec keeps running",
        ),
    ]


def _endpoints_text(ready: int, total: int) -> str:
    return f"{ready}/{total} selected model-server pods ready"


def _converge(
    kube: Kube, pool: PoolSpec, settings: OperatorSettings, result: Result
) -> list[st.Condition]:
    """Bring the pool's objects to the desired set and say what its conditions are.

    Long for a reason: one pass from reading the live objects to writing them, so the
    order (conflicts before writes, writes before prune) is visible in one place."""
    ready, total = count_ready_endpoints(kube, pool)
    result.ready_endpoints = ready
    accepted = st.true(
        c.ACCEPTED, "Accepted", f"infergate serves this pool; {_endpoints_text(ready, total)}"
    )

    if not pool.manages_picker:
        prune(kube, pool, set(), result)
        message = (
            f"endpointPickerRef {pool.picker_group or 'core'}/{pool.picker_kind} is not supported: "
            'infergate deploys Endpoint Pickers behind core Services (group "", kind Service)'
        )
        return [
            accepted,
            st.false(c.RESOLVED_REFS, "InvalidExtensionRef", message),
            st.false(c.READY, "InvalidExtensionRef", message),
        ]

    epp_config = resolve_epp_config(kube, pool)
    live_service = kube.get("Service", pool.namespace, pool.picker_name)
    if live_service is not None and not is_owned_by(live_service, pool.uid):
        # The user runs their own picker behind this Service: resolve it, deploy nothing.
        prune(kube, pool, set(), result)
        ports = [p.get("port") for p in (live_service.get("spec") or {}).get("ports") or []]
        resolved = pool.picker_port in ports
        return [
            accepted,
            st.true(
                c.RESOLVED_REFS,
                "ResolvedRefs",
                f"Service {pool.picker_name} exposes port {pool.picker_port} (not managed by infergate)",
            )
            if resolved
            else st.false(
                c.RESOLVED_REFS,
                "InvalidExtensionRef",
                f"Service {pool.picker_name} does not expose port {pool.picker_port}",
            ),
            st.unknown(
                c.READY,
                "ExternalEndpointPicker",
                f"Service {pool.picker_name} is not managed by infergate; its readiness is not tracked",
            ),
        ]

    # Read once: the Deployment says whether the TLS Secret exists, then is compared.
    live_deployment = kube.get("Deployment", pool.namespace, pool.picker_name)
    fetched = {
        ("Service", pool.picker_name): live_service,
        ("Deployment", pool.picker_name): live_deployment,
    }
    tls = ensure_tls_secret(kube, pool, live_deployment)
    desired = desired_objects(pool, settings, epp_config, tls)
    live_by_key: dict[tuple[str, str], Obj | None] = {}
    conflicts: list[str] = []
    for obj in desired:
        kind, name = obj["kind"], obj["metadata"]["name"]
        if (kind, name) in fetched:
            live = fetched[(kind, name)]
        else:
            live = kube.get(kind, pool.namespace, name)
        if live is not None and not is_owned_by(live, pool.uid):
            conflicts.append(f"{kind}/{name}")
            live_by_key[(kind, name)] = live
            continue
        if not is_up_to_date(live, obj):
            live = kube.apply(obj)
            result.applied.append(f"{kind}/{name}")
        live_by_key[(kind, name)] = live
    prune(kube, pool, set(live_by_key), result)

    service = live_by_key.get(("Service", pool.picker_name)) or {}
    ports = [p.get("port") for p in (service.get("spec") or {}).get("ports") or []]
    resolved_cond = st.true(
        c.RESOLVED_REFS, "ResolvedRefs",
        f"Service {pool.picker_name} exposes the Endpoint Picker on port {pool.picker_port}",
    ) if pool.picker_port in ports else st.false(
        c.RESOLVED_REFS, "InvalidExtensionRef",
        f"Service {pool.picker_name} does not expose port {pool.picker_port}",
    )  # fmt: skip

    if conflicts:
        ready_cond = st.false(
            c.READY, "ObjectConflict",
            f"objects exist that this pool does not own, left untouched: {', '.join(conflicts)}",
        )  # fmt: skip
    else:
        deployment = live_by_key.get(("Deployment", pool.picker_name)) or {}
        dstatus = deployment.get("status") or {}
        available = int(dstatus.get("availableReplicas") or 0)
        current = int(dstatus.get("observedGeneration") or 0) >= int(
            (deployment.get("metadata") or {}).get("generation") or 0
        )
        text = f"{available}/{pool.epp_replicas} Endpoint Picker replicas available; {_endpoints_text(ready, total)}"
        ready_cond = (
            st.true(c.READY, "EndpointPickerAvailable", text)
            if available >= 1 and current
            else st.false(c.READY, "EndpointPickerUnavailable", text)
        )
    return [accepted, resolved_cond, ready_cond]


def reconcile(
    kube: Kube, namespace: str, name: str, settings: OperatorSettings, now: str | None = None
) -> Result:
    """Bring one pool's objects and status in line with its spec; idempotent."""
    for attempt in range(3):
        result = Result()
        body = kube.get(c.POOL_KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            result.found = False
            return result  # owned objects go with the pool (ownerReferences)
        meta = body["metadata"]
        if not settings.manage_endpoint_pickers:
            return _unmanaged(kube, body, settings, result)
        ready_endpoints: int | None = None
        try:
            pool = parse_pool(body, settings)
            conditions = _converge(kube, pool, settings, result)
            ready_endpoints = result.ready_endpoints
        except InvalidPool as error:
            conditions = _not_accepted(error.reason, error.message)
        except _NotAccepted as error:
            conditions = _not_accepted(error.reason, error.message)
        result.conditions = conditions

        live_parents: list[Obj] = (body.get("status") or {}).get("parents") or []
        new_parents = st.build_parents(
            live_parents, conditions, int(meta.get("generation") or 0), ready_endpoints, now
        )
        _post_events(kube, body, result, live_parents, new_parents)
        if new_parents == live_parents:
            return result
        try:
            kube.patch_status(
                c.POOL_KIND,
                namespace,
                name,
                {"parents": new_parents},
                resource_version=meta.get("resourceVersion", ""),
            )
            result.status_written = True
            return result
        except KubeError as error:
            if error.status != 409 or attempt == 2:
                raise
            log.info("status of %s/%s changed meanwhile; reconciling again", namespace, name)
    return result


def _unmanaged(kube: Kube, body: Obj, settings: OperatorSettings, result: Result) -> Result:
    """The operator manages no Endpoint Picker: remove what it deployed for the pool
    before, and its own parent entry (the Gateway controller reports the pool per
    Gateway; GIE expects no other parent once no route uses the pool)."""
    meta = body["metadata"]
    with contextlib.suppress(InvalidPool):
        prune(kube, parse_pool(body, settings), set(), result)
    live: list[Obj] = (body.get("status") or {}).get("parents") or []
    kept = [p for p in live if p.get("controllerName") != c.CONTROLLER_NAME]
    if kept != live:
        kube.patch_status(
            c.POOL_KIND, meta["namespace"], meta["name"], {"parents": kept},
            resource_version=meta.get("resourceVersion", ""),
        )  # fmt: skip
        result.status_written = True
    return result


def _post_events(kube: Kube, body: Obj, result: Result, old: list[Obj], new: list[Obj]) -> None:
    if result.applied:
        kube.event(body, "Normal", "Applied", "applied " + ", ".join(result.applied))
    if result.deleted:
        kube.event(body, "Normal", "Deleted", "deleted " + ", ".join(result.deleted))
    for cond in st.changed_conditions(old, new):
        kind = "Normal" if cond["status"] == "True" else "Warning"
        kube.event(
            body, kind, cond["reason"], f"{cond['type']}={cond['status']}: {cond['message']}"
        )
