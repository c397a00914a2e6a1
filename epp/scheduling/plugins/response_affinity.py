"""Previous-response affinity: send the next turn of a Responses conversation to the engine
that produced the previous one.

A Responses request that names ``previous_response_id`` is cheapest (and, with per-engine
response stores, only answerable) on the engine holding that response: its KV blocks are
cached there and its store has the conversation. The EPP learns that engine from the id
itself (:mod:`infergate.wire.responses`): the Director sends every routed request with
``x-infergate-route-tag`` = the tag of the picked endpoint's ``host:port``, the engine
embeds the tag in the response ids it makes, and these plugins map the tag of
``previous_response_id`` back to an endpoint. Nothing is stored per conversation, so the
affinity survives EPP restarts and holds across EPP replicas. Each keeps a tag → endpoint
map, updated as discovery adds and removes endpoints, so a request costs one regex match
and one dict lookup, not a pass over the fleet.

Two forms:

* ``response-affinity-filter`` (the default profile's first filter): when the holder is a
  candidate, it is the only one left. Another engine's store does not have the
  conversation, so a turn sent elsewhere can only be answered 404; load-balancing filters
  after it (``bounded-load-filter``) see one endpoint and keep it. A holder that is gone
  (not a candidate: stale or removed) leaves the list unchanged.
* ``response-affinity-scorer``: 1 for the holder, 0 for the others, for stores shared by
  every engine, where another engine could answer and affinity is only a cache preference.

Both are neutral when the request names no response, the id is not one of ours, or its
tag names no known endpoint.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from infergate.epp.scheduling.plugins.base import Filter, Plugin, PluginContext, Scorer, register
from infergate.epp.types import CycleState, Endpoint, EndpointState, InferenceRequest
from pydantic import BaseModel, ConfigDict

from infergate.wire.responses import route_tag, route_tag_of

log = logging.getLogger("infergate.epp.response_affinity")

#: ``GET``/``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and
#: ``GET /v1/responses/{id}/input_items`` name the response in the path.
_PATH_ID = re.compile(r"/v1/responses/(resp_[0-9a-f]{48})(?:/[a-z_]+)?/?(?:\?.*)?")
#: The cycle-state key holding the holder's endpoint key (absent: no holder known).
HOLDER = "response_affinity.holder"


class ResponseAffinityParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    #: Also route requests that name a response in their path (retrieve, delete, cancel,
    #: input items) to its holder, whose store is the one that has it.
    byPath: bool = True


class _ResponseAffinity(Plugin):
    """The tag → endpoint map and the holder lookup both forms share."""

    Params = ResponseAffinityParams

    def __init__(self, name: str, params: BaseModel, context: PluginContext) -> None:
        super().__init__(name, params, context)
        self.p: ResponseAffinityParams = params  # type: ignore[assignment]
        self._by_tag: dict[str, str] = {}
        self._on_endpoints([s.endpoint for s in context.datastore.all()], [])
        context.datastore.subscribe(self._on_endpoints)
        self.metrics: Any = context.extras.get("metrics")
        #: Requests that named one of our response ids, by outcome (also exported as
        #: ``infergate_epp_response_affinity_total{outcome}`` when the EPP has metrics).
        self.found = 0
        self.unknown = 0
        self.filtered = 0

    def _on_endpoints(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        # Removals first: a relabelled endpoint comes as removed and added with one key.
        for endpoint in removed:
            tag = route_tag(endpoint.key)
            if self._by_tag.get(tag) == endpoint.key:
                del self._by_tag[tag]
        for endpoint in added:
            self._by_tag[route_tag(endpoint.key)] = endpoint.key

    def holder_of(self, request: InferenceRequest) -> str | None:
        """The key of the endpoint holding the response the request names, if known."""
        response_id = request.previous_response_id
        if not response_id and self.p.byPath:
            match = _PATH_ID.fullmatch(request.headers.get(":path", ""))
            response_id = match.group(1) if match else ""
        tag = route_tag_of(response_id)
        if tag is None:
            return None
        holder = self._by_tag.get(tag)
        if holder is None:
            self.unknown += 1
            self._count("unknown")
            log.debug("request %s: response %s names no known endpoint", request.request_id,
                      response_id)  # fmt: skip
        return holder

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.response_affinity.labels(outcome).inc()

    def candidate_holder(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> int | None:
        """The holder's index in `endpoints` (counted and noted in `cycle`), else None."""
        holder = self.holder_of(request)
        if holder is None:
            return None
        for i, endpoint in enumerate(endpoints):
            if endpoint.key == holder:
                self.found += 1
                self._count("holder")
                cycle[HOLDER] = holder
                return i
        self.filtered += 1
        self._count("filtered")
        log.debug("request %s: holder %s is not a candidate", request.request_id, holder)
        return None


@register
class ResponseAffinityFilter(_ResponseAffinity, Filter):
    """Only the endpoint that produced ``previous_response_id``, when it is a candidate."""

    type_name = "response-affinity-filter"

    def filter(
        self, cycle: CycleState, request: InferenceRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        index = self.candidate_holder(cycle, request, endpoints)
        return endpoints if index is None else [endpoints[index]]


@register
class ResponseAffinityScorer(_ResponseAffinity, Scorer):
    """1 for the endpoint that produced ``previous_response_id``, 0 for the others."""

    type_name = "response-affinity-scorer"

    def score(
        self, cycle: CycleState, request: InferenceRequest, endpoints: Sequence[EndpointState]
    ) -> list[float]:
        index = self.candidate_holder(cycle, request, endpoints)
        return [1.0 if i == index else 0.0 for i in range(len(endpoints))]
