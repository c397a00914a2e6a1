"""Filters: narrow the candidate endpoints before scoring."""

from __future__ import annotations

import ipaddress
import time

from infergate.epp.scheduling.plugins.base import Filter, register
from infergate.epp.types import CycleState, EndpointState, InferenceRequest

TEST_SELECTION_HEADER = "test-epp-endpoint-selection"


@register
class SaturationFilter(Filter):
    """Drop saturated endpoints (long queue, full KV cache, stale metrics).

    Fails open: when every candidate is saturated it keeps them all, so load is spread
    by the scorers instead of refusing traffic that admission already let in.
    """

    type_name = "saturation-filter"

    def filter(
        self, cycle: CycleState, request: InferenceRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        detector = self.context.saturation
        now = time.monotonic()
        kept = [e for e in endpoints if not detector.is_saturated(e, now)]
        return kept or endpoints


def _normal_host(host: str) -> str:
    host = host.strip().strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _split(item: str) -> tuple[str, str]:
    """``ip``, ``ip:port``, ``[v6]:port`` → (host, port or "")."""
    item = item.strip()
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        return _normal_host(host), rest.lstrip(":")
    if item.count(":") == 1:
        host, port = item.split(":")
        return _normal_host(host), port.strip()
    return _normal_host(item), ""


@register
class HeaderBasedTestingFilter(Filter):
    """GIE conformance's filter: keep only the endpoints named in ``test-epp-endpoint-selection``.

    The header is a comma-separated list of ``ip`` or ``ip:port``; a port demands an exact
    match, a bare IP matches any port of that address. The order of the header is kept (the
    first listed endpoint is the primary). No header, or no match, leaves no candidate,
    which the EPP answers with 503 — as GIE's conformance profile expects.
    """

    type_name = "header-based-testing-filter"

    def filter(
        self, cycle: CycleState, request: InferenceRequest, endpoints: list[EndpointState]
    ) -> list[EndpointState]:
        value = request.headers.get(TEST_SELECTION_HEADER, "")
        if not value.strip():
            return []
        by_host: dict[str, list[EndpointState]] = {}
        for state in endpoints:
            by_host.setdefault(_normal_host(state.endpoint.address), []).append(state)
        chosen: list[EndpointState] = []
        seen: set[str] = set()
        for item in value.split(","):
            if not item.strip():
                continue
            host, port = _split(item)
            for state in by_host.get(host, []):
                if (not port or str(state.endpoint.port) == port) and state.key not in seen:
                    seen.add(state.key)
                    chosen.append(state)
        cycle["test.selection_order"] = [s.key for s in chosen]
        return chosen
