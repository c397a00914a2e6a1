"""Status conditions in ``metav1.Condition`` shape, and the reasons the specs name.

The translator is pure, so ``lastTransitionTime`` comes from the object's current status:
a condition whose status did not flip keeps its time, so a resync that changes nothing
writes nothing (and a status writer can compare dicts).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from infergate.gateway.model import as_dict, as_list, as_str
from infergate.gateway.types import Obj

ACCEPTED = "Accepted"
PROGRAMMED = "Programmed"
RESOLVED_REFS = "ResolvedRefs"
CONFLICTED = "Conflicted"
SUPPORTED_VERSION = "SupportedVersion"
PARTIALLY_INVALID = "PartiallyInvalid"

# Reasons (Gateway API v1 and GIE v1), by the condition they go with.
INVALID = "Invalid"
PENDING = "Pending"
INVALID_PARAMETERS = "InvalidParameters"
UNSUPPORTED_VERSION = "UnsupportedVersion"
LISTENERS_NOT_VALID = "ListenersNotValid"
UNSUPPORTED_ADDRESS = "UnsupportedAddress"
UNSUPPORTED_PROTOCOL = "UnsupportedProtocol"
UNSUPPORTED_VALUE = "UnsupportedValue"
PORT_UNAVAILABLE = "PortUnavailable"
NO_CONFLICTS = "NoConflicts"
HOSTNAME_CONFLICT = "HostnameConflict"
PROTOCOL_CONFLICT = "ProtocolConflict"
INVALID_ROUTE_KINDS = "InvalidRouteKinds"
NOT_ALLOWED_BY_LISTENERS = "NotAllowedByListeners"
NO_MATCHING_LISTENER_HOSTNAME = "NoMatchingListenerHostname"
NO_MATCHING_PARENT = "NoMatchingParent"
REF_NOT_PERMITTED = "RefNotPermitted"
INVALID_KIND = "InvalidKind"
BACKEND_NOT_FOUND = "BackendNotFound"
INVALID_EXTENSION_REF = "InvalidExtensionRef"
HTTPROUTE_NOT_ACCEPTED = "HTTPRouteNotAccepted"
EPP_REF_MISSING = "EndpointPickerRefMissing"

#: Kubernetes caps a condition message at 32768 characters.
MAX_MESSAGE = 32768


@dataclass(frozen=True)
class Condition:
    """One condition before rendering: status is "True", "False" or "Unknown"."""

    type: str
    status: str
    reason: str
    message: str


def true(type_: str, reason: str, message: str = "") -> Condition:
    return Condition(type_, "True", reason, message)


def false(type_: str, reason: str, message: str = "") -> Condition:
    return Condition(type_, "False", reason, message)


def now_rfc3339() -> str:
    """Now, as Kubernetes writes times (second precision, UTC, ``Z``)."""
    stamp = datetime.datetime.now(tz=datetime.UTC).replace(microsecond=0)
    return stamp.isoformat().replace("+00:00", "Z")


def render(conditions: Iterable[Condition], previous: Any, generation: int, now: str) -> list[Obj]:
    """Conditions as dicts; ``lastTransitionTime`` moves only when a status flips."""
    before = {as_str(c.get("type")): c for c in map(as_dict, as_list(previous))}
    out = []
    for cond in conditions:
        old = before.get(cond.type, {})
        since = as_str(old.get("lastTransitionTime"))
        if not since or old.get("status") != cond.status:
            since = now
        out.append(
            {
                "type": cond.type,
                "status": cond.status,
                "reason": cond.reason,
                "message": cond.message[:MAX_MESSAGE],
                "observedGeneration": generation,
                "lastTransitionTime": since,
            }
        )
    return out
