"""Reading Kubernetes JSON bodies defensively, for the translator.

The API server validates Gateway API and GIE objects against their CRD schemas, but the
translator must never raise on what it is handed (an older CRD, a hand-made object in a
test, a field another controller added): every accessor here returns a typed default
when a field is missing or has the wrong JSON type, so bad input becomes a status
condition upstream and never an exception.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from infergate.gateway.types import Key, Obj

CORE_GROUP = ""
POOL_GROUP = "inference.networking.k8s.io"
POOL_KIND = "InferencePool"
SERVICE_KIND = "Service"
HTTPROUTE_KIND = "HTTPRoute"
GATEWAY_KIND = "Gateway"


def as_dict(value: Any) -> dict[str, Any]:
    """``value`` if it is a JSON object, else an empty one."""
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    """``value`` if it is a JSON array, else an empty one."""
    return value if isinstance(value, list) else []


def as_str(value: Any, default: str = "") -> str:
    """``value`` if it is a string, else ``default``."""
    return value if isinstance(value, str) else default


def as_int(value: Any) -> int | None:
    """``value`` if it is an integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def dig(obj: Any, *path: str) -> Any:
    """``obj[path[0]][path[1]]…``, or None as soon as a step is not an object."""
    for step in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(step)
    return obj


def str_map(value: Any) -> dict[str, str]:
    """A ``map[string]string`` (labels, matchLabels), dropping entries of other types."""
    return {k: v for k, v in as_dict(value).items() if isinstance(k, str) and isinstance(v, str)}


@dataclass(frozen=True)
class Meta:
    """The parts of ``metadata`` the translator uses (with safe defaults)."""

    namespace: str
    name: str
    generation: int
    created: str
    labels: Mapping[str, str]

    @property
    def key(self) -> Key:
        return (self.namespace, self.name)


def meta(obj: Any) -> Meta:
    """``obj``'s metadata; a missing generation reads as 0, a missing timestamp as ""."""
    m = as_dict(as_dict(obj).get("metadata"))
    return Meta(
        namespace=as_str(m.get("namespace")),
        name=as_str(m.get("name")),
        generation=as_int(m.get("generation")) or 0,
        created=as_str(m.get("creationTimestamp")),
        labels=str_map(m.get("labels")),
    )


def index(objects: Iterable[Obj]) -> dict[Key, Obj]:
    """Namespaced objects by ``(namespace, name)``; nameless ones are dropped."""
    out: dict[Key, Obj] = {}
    for obj in objects:
        m = meta(obj)
        if m.name and isinstance(obj, dict):
            out[m.key] = obj
    return out


def selector_matches(selector: Any, labels: Mapping[str, str]) -> bool | None:
    """Kubernetes LabelSelector semantics (matchLabels AND matchExpressions).

    Returns None when the selector itself is malformed (an unknown operator, a value
    list where none is allowed), so the caller can report it rather than guess."""
    sel = as_dict(selector)
    for key, value in str_map(sel.get("matchLabels")).items():
        if labels.get(key) != value:
            return False
    for expression in as_list(sel.get("matchExpressions")):
        verdict = _expression_matches(as_dict(expression), labels)
        if verdict is None:
            return None
        if not verdict:
            return False
    return True


def selector_valid(selector: Any) -> bool:
    """Whether a LabelSelector is well formed (known operators, values where needed)."""
    if not isinstance(selector, dict):
        return False
    for expression in as_list(selector.get("matchExpressions")):
        expression = as_dict(expression)
        operator = expression.get("operator")
        values = as_list(expression.get("values"))
        if not as_str(expression.get("key")) or operator not in _OPERATORS:
            return False
        if (operator in ("In", "NotIn")) != bool(values):
            return False
    return True


_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def _expression_matches(expression: dict[str, Any], labels: Mapping[str, str]) -> bool | None:
    key = as_str(expression.get("key"))
    operator = as_str(expression.get("operator"))
    values = [v for v in as_list(expression.get("values")) if isinstance(v, str)]
    if not key:
        return None
    if operator == "In":
        return key in labels and labels[key] in values
    if operator == "NotIn":
        return key not in labels or labels[key] not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    return None


def pod_serving_ip(pod: Obj) -> tuple[str, bool] | None:
    """The pod's IP while its Ready condition holds (a valid IP), and whether the pod is
    terminating: Kubernetes' EndpointSlice ``serving`` and ``terminating`` conditions
    (KEP-1672). ``ready`` is serving and not terminating; a terminating pod stays
    serving until its readiness probe fails (it keeps serving through a preStop hook)."""
    ready = any(
        as_dict(c).get("type") == "Ready" and as_dict(c).get("status") == "True"
        for c in as_list(dig(pod, "status", "conditions"))
    )
    ip = as_str(dig(pod, "status", "podIP"))
    if not ready or not ip:
        return None
    try:
        ipaddress.ip_address(ip)
    except ValueError:
        return None
    return ip, bool(dig(pod, "metadata", "deletionTimestamp"))


def named_container_port(pod: Obj, name: str) -> int | None:
    """The number of the pod's container port called ``name`` (a Service's named
    targetPort), TCP only."""
    for container in as_list(dig(pod, "spec", "containers")):
        for port in as_list(as_dict(container).get("ports")):
            port = as_dict(port)
            if port.get("name") == name and as_str(port.get("protocol"), "TCP") == "TCP":
                number = as_int(port.get("containerPort"))
                if number is not None and valid_port(number):
                    return number
    return None


def valid_port(number: int | None) -> bool:
    return number is not None and 0 < number < 65536


def ref_permitted(
    grants: Iterable[Obj],
    *,
    from_kind: str,
    from_namespace: str,
    to_group: str,
    to_kind: str,
    to_namespace: str,
    to_name: str,
    from_group: str = "gateway.networking.k8s.io",
) -> bool:
    """Whether a reference may cross namespaces: same namespace, or a ReferenceGrant in
    the target namespace lets ``from_kind`` objects of ``from_namespace`` refer to it."""
    if from_namespace == to_namespace:
        return True
    for grant in grants:
        if meta(grant).namespace != to_namespace:
            continue
        spec = as_dict(as_dict(grant).get("spec"))
        if _grant_from(spec, from_group, from_kind, from_namespace) and _grant_to(
            spec, to_group, to_kind, to_name
        ):
            return True
    return False


def _grant_from(spec: dict[str, Any], group: str, kind: str, namespace: str) -> bool:
    return any(
        as_str(f.get("group")) == group
        and as_str(f.get("kind")) == kind
        and as_str(f.get("namespace")) == namespace
        for f in map(as_dict, as_list(spec.get("from")))
    )


def _grant_to(spec: dict[str, Any], group: str, kind: str, name: str) -> bool:
    return any(
        as_str(t.get("group")) == group
        and as_str(t.get("kind")) == kind
        and as_str(t.get("name")) in ("", name)
        for t in map(as_dict, as_list(spec.get("to")))
    )
