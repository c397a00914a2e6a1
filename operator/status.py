"""Pool status in GIE's ``status.parents[]`` shape (pure functions).

The operator owns exactly one entry: the one whose ``controllerName`` is
CONTROLLER_NAME, with ``parentRef`` OPERATOR_PARENT_REF (see constants). Entries that
Gateway implementations write for their Gateways are kept untouched.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from infergate.operator import constants as c

Obj = dict[str, Any]


def now_rfc3339() -> str:
    return (
        datetime.datetime.now(tz=datetime.UTC)
        .replace(microsecond=0)
        .isoformat()
        .replace("+00:00", "Z")
    )


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str

    def to_dict(self, generation: int, transition_time: str) -> Obj:
        return {
            "type": self.type,
            "status": self.status,
            "reason": self.reason,
            "message": self.message[:32768],
            "observedGeneration": generation,
            "lastTransitionTime": transition_time,
        }


def true(type_: str, reason: str, message: str) -> Condition:
    return Condition(type_, "True", reason, message)


def false(type_: str, reason: str, message: str) -> Condition:
    return Condition(type_, "False", reason, message)


def unknown(type_: str, reason: str, message: str) -> Condition:
    return Condition(type_, "Unknown", reason, message)


def our_entry(parents: list[Obj]) -> Obj | None:
    for entry in parents:
        if entry.get("controllerName") == c.CONTROLLER_NAME:
            return entry
    return None


def render_conditions(
    conditions: list[Condition], previous: list[Obj], generation: int, now: str
) -> list[Obj]:
    """Conditions as dicts; lastTransitionTime moves only when a status flips."""
    before = {p.get("type"): p for p in previous}
    rendered = []
    for cond in conditions:
        old = before.get(cond.type)
        since = old["lastTransitionTime"] if old and old.get("status") == cond.status else now
        rendered.append(cond.to_dict(generation, since))
    return rendered


def build_parents(
    live_parents: list[Obj],
    conditions: list[Condition],
    generation: int,
    ready_endpoints: int | None,
    now: str | None = None,
) -> list[Obj]:
    """The new ``status.parents``: ours replaced (or added first), others kept."""
    previous = our_entry(live_parents) or {}
    entry: Obj = {
        "parentRef": dict(c.OPERATOR_PARENT_REF),
        "controllerName": c.CONTROLLER_NAME,
        "conditions": render_conditions(
            conditions, previous.get("conditions") or [], generation, now or now_rfc3339()
        ),
    }
    if ready_endpoints is not None:
        entry["readyEndpoints"] = ready_endpoints
    others = [p for p in live_parents if p.get("controllerName") != c.CONTROLLER_NAME]
    return [entry, *others]


def changed_conditions(old_parents: list[Obj], new_parents: list[Obj]) -> list[Obj]:
    """Our conditions whose status or reason differ from before (for Events)."""
    old = {x["type"]: x for x in ((our_entry(old_parents) or {}).get("conditions") or [])}
    new = (our_entry(new_parents) or {}).get("conditions") or []
    return [
        cond
        for cond in new
        if cond["type"] not in old
        or (old[cond["type"]]["status"], old[cond["type"]]["reason"])
        != (cond["status"], cond["reason"])
    ]
