"""Status as the Gateway controller writes it (pure functions).

The translator says what each object's status should be; these functions make that a
write that is safe to repeat and to share:

* ``lastTransitionTime`` moves only when a condition's status flips, so a resync that
  changes nothing writes nothing (the translator is pure and cannot know the time);
* HTTPRoute and InferencePool ``status.parents`` keep every entry another controller
  wrote (another Gateway implementation's, and on pools the operator's own standalone
  entry from :mod:`infergate.operator.status`); only entries whose ``controllerName``
  is ours are replaced;
* "unchanged" means every field we want is already there with our value (the API server
  adds defaults, e.g. ``parentRef.group``, that we need not repeat).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from infergate.gateway.types import GATEWAY_CONTROLLER_NAME, GATEWAY_GROUP
from infergate.operator.reconcile import is_subset

Obj = dict[str, Any]


def stamp_conditions(new: Iterable[Obj], old: Iterable[Obj], now: str) -> list[Obj]:
    """``new`` with each condition's ``lastTransitionTime`` kept from ``old`` while its
    status is the same, else ``now``."""
    before = {str(cond.get("type")): cond for cond in old or ()}
    stamped = []
    for cond in new:
        previous = before.get(str(cond.get("type")))
        same = previous is not None and previous.get("status") == cond.get("status")
        since = previous.get("lastTransitionTime") if same and previous else None
        stamped.append({**cond, "lastTransitionTime": since or now})
    return stamped


def stamp_gateway_status(new: Obj, old: Obj, now: str) -> Obj:
    """A Gateway's (or GatewayClass's) whole status: its conditions and its listeners'."""
    out = dict(new)
    out["conditions"] = stamp_conditions(
        new.get("conditions") or [], old.get("conditions") or [], now
    )
    if "listeners" in new:
        old_listeners = {str(li.get("name")): li for li in old.get("listeners") or []}
        out["listeners"] = [
            {
                **listener,
                "conditions": stamp_conditions(
                    listener.get("conditions") or [],
                    (old_listeners.get(str(listener.get("name"))) or {}).get("conditions") or [],
                    now,
                ),
            }
            for listener in new["listeners"]
        ]
    return out


def _ref_key(ref: Obj, namespace: str) -> tuple[str, ...]:
    """A parentRef with the API's defaults filled in, to match an entry across writes."""
    return (
        str(ref.get("group") if ref.get("group") is not None else GATEWAY_GROUP),
        str(ref.get("kind") or "Gateway"),
        str(ref.get("namespace") or namespace),
        str(ref.get("name") or ""),
        str(ref.get("sectionName") or ""),
        str(ref.get("port") or ""),
    )


def is_ours(entry: Obj) -> bool:
    return entry.get("controllerName") == GATEWAY_CONTROLLER_NAME


#: HTTPRoute and InferencePool ``status.parents`` hold at most 32 entries.
MAX_PARENTS = 32


def merge_parents(live: list[Obj], ours: Iterable[Obj], namespace: str, now: str) -> list[Obj]:
    """The new ``status.parents``: every other controller's entry as it is, then ours
    (stamped; an entry of ours no Gateway wants any more is dropped), at most
    MAX_PARENTS in all (the API server refuses more; other controllers' come first)."""
    before = {_ref_key(e.get("parentRef") or {}, namespace): e for e in live if is_ours(e)}
    mine = []
    for entry in ours:
        previous = before.get(_ref_key(entry.get("parentRef") or {}, namespace)) or {}
        mine.append(
            {
                **entry,
                "controllerName": GATEWAY_CONTROLLER_NAME,
                "conditions": stamp_conditions(
                    entry.get("conditions") or [], previous.get("conditions") or [], now
                ),
            }
        )
    return ([e for e in live if not is_ours(e)] + mine)[:MAX_PARENTS]


def unchanged(desired: Any, live: Any) -> bool:
    """True when writing ``desired`` would change nothing in ``live``."""
    return is_subset(desired, live)


def status_patch(desired: Obj, live: Obj) -> Obj:
    """A merge patch that makes the status exactly ``desired``: top-level fields we no
    longer report are removed (``null``), lists are replaced whole."""
    patch: Obj = {key: None for key in live if key not in desired}
    patch.update(desired)
    return patch
