"""Plugins GIE's conformance suite configures (test-only behaviour, harmless otherwise)."""

from __future__ import annotations

from infergate.epp.framework.requestcontrol import ResponseHeaders, ResponseInfo
from infergate.epp.scheduling.plugins.base import SchedulingResult, register
from infergate.epp.types import InferenceRequest

CONFORMANCE_RESULT_HEADER = "x-conformance-test-served-endpoint"


@register
class DestinationEndpointServedVerifier(ResponseHeaders):
    """Echo the endpoint Envoy reports as served (metadata ``envoy.lb`` /
    ``x-gateway-destination-endpoint-served``) in ``x-conformance-test-served-endpoint``."""

    type_name = "destination-endpoint-served-verifier"

    def response_headers(
        self, request: InferenceRequest, result: SchedulingResult | None, response: ResponseInfo
    ) -> dict[str, str]:
        lb = response.metadata.get("envoy.lb")
        if not isinstance(lb, dict):
            value = "fail: missing envoy lb metadata"
        else:
            served = lb.get("x-gateway-destination-endpoint-served")
            value = (
                served
                if isinstance(served, str)
                else "fail: missing destination endpoint served metadata"
            )
        return {CONFORMANCE_RESULT_HEADER: value}
