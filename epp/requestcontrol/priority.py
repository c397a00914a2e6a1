"""A request's priority is the pool owner's: the InferenceObjective's, not the client's.

Engines schedule by the body's ``priority`` (vLLM's convention: lower runs first) and,
without one, by the EPP's ``x-infergate-priority`` header (always set by the EPP, so a
client's own copy never reaches the engine). Left alone, a client's ``"priority": -100``
would jump every queue. So, at end of body:

* by default (``--client-priority-max`` unset) the priority is the objective's, and a
  client's body ``priority`` is removed (the body is rewritten only then);
* where the pool's owner opts in, a client's priority (the body's ``priority`` or the
  ``x-infergate-priority`` header, vLLM's convention) replaces the objective's, clamped:
  a client may lower its urgency freely but raise it only up to the bound (GIE's
  convention: higher is more important). The body then carries the clamped value.

``request.priority`` (GIE's convention) is what flow control, shedding and the header use.
"""

from __future__ import annotations

from typing import Any

from infergate.epp.requestcontrol.requests import BadRequest
from infergate.epp.types import InferenceRequest

from infergate.wire.names import PRIORITY_HEADER

__all__ = ["clamp_client_priority", "client_priority", "settle_priority"]

#: The body field vLLM's scheduler reads (``--scheduling-policy priority``).
BODY_FIELD = "priority"


def clamp_client_priority(requested: int, ceiling: int) -> int:
    """The priority a client gets when it asks for ``requested`` (GIE's convention,
    higher is more important): anything up to ``ceiling``, never above it."""
    return min(requested, ceiling)


def client_priority(body: dict[str, Any] | None, headers: dict[str, str]) -> int | None:
    """What the client asks for, in GIE's convention (negated from vLLM's): the body's
    ``priority``, else the ``x-infergate-priority`` header; None when it asks nothing.
    Not an integer: 400 naming the field."""
    if body is not None and BODY_FIELD in body:
        value = body[BODY_FIELD]
        if type(value) is not int:
            raise BadRequest("'priority' must be an integer", BODY_FIELD)
        return -value
    raw = headers.get(PRIORITY_HEADER)
    if raw is None:
        return None
    try:
        return -int(raw.strip())
    except ValueError:
        raise BadRequest(f"{PRIORITY_HEADER} must be an integer", PRIORITY_HEADER) from None


def settle_priority(
    request: InferenceRequest,
    body: dict[str, Any] | None,
    objective_priority: int,
    ceiling: int | None,
) -> bool:
    """Set ``request.priority`` and make the body agree; True when ``body`` changed (the
    caller re-encodes it). ``ceiling`` None: clients' priority is ignored."""
    if ceiling is None:
        request.priority = objective_priority
        if body is not None and BODY_FIELD in body:
            del body[BODY_FIELD]
            return True
        return False
    asked = client_priority(body, request.headers)
    if asked is None:
        request.priority = objective_priority
        return False
    request.priority = clamp_client_priority(asked, ceiling)
    if body is not None and BODY_FIELD in body and body[BODY_FIELD] != -request.priority:
        body[BODY_FIELD] = -request.priority
        return True
    return False
