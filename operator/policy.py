"""Status for the pool's policy objects, InferenceObjective and InferenceModelRewrite.

The EPP acts on them; the operator tells their authors whether they attach to anything:
their ``poolRef`` must name an InferencePool that exists in the same namespace.
InferenceObjective reports ``Ready``, InferenceModelRewrite ``Accepted`` (the condition
types GIE's CRDs default to ``Unknown/Pending``).
"""

from __future__ import annotations

from typing import Any

from infergate.operator import constants as c
from infergate.operator import status as st
from infergate.operator.kube import Kube, KubeError

Obj = dict[str, Any]

#: kind -> the condition type it reports.
POLICY_KINDS = {"InferenceObjective": "Ready", "InferenceModelRewrite": "Accepted"}


def policy_condition(obj: Obj, pool_exists: bool | None) -> st.Condition:
    """The condition for one policy object; ``pool_exists`` None = not looked up."""
    type_ = POLICY_KINDS[obj["kind"]]
    ref = (obj.get("spec") or {}).get("poolRef") or {}
    group = ref.get("group", c.POOL_GROUP)
    kind = ref.get("kind", c.POOL_KIND)
    if (group, kind) != (c.POOL_GROUP, c.POOL_KIND):
        return st.false(
            type_, "UnsupportedPoolRef", f"poolRef {group}/{kind} is not an InferencePool"
        )
    if not pool_exists:
        return st.false(
            type_,
            "PoolNotFound",
            f"InferencePool {ref.get('name')!r} does not exist in this namespace",
        )
    reason = "Ready" if type_ == "Ready" else "Accepted"
    return st.true(type_, reason, f"attached to InferencePool {ref.get('name')!r}")


def reconcile_policy(
    kube: Kube, kind: str, namespace: str, name: str, now: str | None = None
) -> bool:
    """Write the object's condition if it changed; True if a status write happened."""
    obj = kube.get(kind, namespace, name)
    if obj is None or obj["metadata"].get("deletionTimestamp"):
        return False
    ref = (obj.get("spec") or {}).get("poolRef") or {}
    exists = bool(ref.get("name")) and kube.get(c.POOL_KIND, namespace, ref["name"]) is not None
    condition = policy_condition(obj, exists)
    live = (obj.get("status") or {}).get("conditions") or []
    generation = int(obj["metadata"].get("generation") or 0)
    rendered = st.render_conditions([condition], live, generation, now or st.now_rfc3339())
    others = [x for x in live if x.get("type") != condition.type]
    new = [*rendered, *others]
    if new == live:
        return False
    try:
        kube.patch_status(
            kind,
            namespace,
            name,
            {"conditions": new},
            resource_version=obj["metadata"].get("resourceVersion", ""),
        )
    except KubeError as error:
        if error.status == 409:
            return reconcile_policy(kube, kind, namespace, name, now)
        raise
    if not live or {x["type"]: x["status"] for x in live}.get(condition.type) != condition.status:
        kube.event(
            obj,
            "Normal" if condition.status == "True" else "Warning",
            condition.reason,
            condition.message,
        )
    return True
