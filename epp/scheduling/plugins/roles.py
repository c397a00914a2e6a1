"""Prefill/decode roles of endpoints, and the filters that split a pool by them.

An engine's role comes from its labels — pod labels under Kubernetes discovery, the
``labels`` of an entry in the ``--endpoints`` file locally — under llm-d's key
``llm-d.ai/role`` (values ``prefill``, ``decode``, ``both``). infergate's own key
``infergate.dev/role`` is read when llm-d's is absent. An endpoint with neither label is
``both``: a pool that never heard of P/D keeps working when a P/D config is applied.

As in llm-d, ``decode-filter`` keeps ``decode`` and ``both`` endpoints and
``prefill-filter`` keeps only ``prefill`` ones (a ``both`` engine is a decode target; it
prefills for itself).
"""

from __future__ import annotations

import time

from infergate.epp.scheduling.plugins.base import Filter, register
from infergate.epp.types import CycleState, Endpoint, EndpointState, InferenceRequest

ROLE_LABEL = "llm-d.ai/role"
INFERGATE_ROLE_LABEL = "infergate.dev/role"
PREFILL = "prefill"
DECODE = "decode"
BOTH = "both"
ROLES = (PREFILL, DECODE, BOTH)


def role_of(endpoint: Endpoint) -> str:
    """The endpoint's role; unknown values and no label at all count as ``both``."""
    value = endpoint.label(ROLE_LABEL) or endpoint.label(INFERGATE_ROLE_LABEL) or BOTH
    value = value.strip().lower()
    return value if value in ROLES else BOTH


@register
class DecodeFilter(Filter):
    """Keep endpoints that can decode (role ``decode`` or ``both``)."""

    type_name = "decode-filter"

    def filter(
        self, cycle: CycleState, request: InferenceRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        return [e for e in endpoints if role_of(e.endpoint) in (DECODE, BOTH)]


@register
class PrefillFilter(Filter):
    """Keep endpoints dedicated to prefill (role ``prefill``) whose metrics are fresh.

    A prefill engine whose metrics went stale (older than the staleness threshold: dead,
    or accepting connections and never answering) leaves the prefill profile. Naming it to
    the decode engine in ``x-prefiller-host-port`` would make that engine wait for a pull
    that never comes (its KV-transfer timeout) where a refused connection fails at once;
    with no fresh prefill engine the profile finds none and the decode engine prefills
    itself.
    """

    type_name = "prefill-filter"

    def filter(
        self, cycle: CycleState, request: InferenceRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        now = time.monotonic()
        stale = self.context.saturation.is_stale
        return [e for e in endpoints if role_of(e.endpoint) == PREFILL and not stale(e, now)]
