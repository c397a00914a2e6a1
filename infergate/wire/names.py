"""The header and metadata names Envoy, the Endpoint Picker and the engines agree on.

GIE's Endpoint Picker Protocol: the EPP answers with the picked endpoint(s) in the
``x-gateway-destination-endpoint`` header and the same value as dynamic metadata under
``envoy.lb``; a gateway may restrict the candidates with the subset hint in
``envoy.lb.subset_hint``; Envoy reports the endpoint really used back to the EPP as
``x-gateway-destination-endpoint-served`` in ``envoy.lb``. ``x-infergate-request-id``
is ours: the EPP's id for a routed request, which the observer filter's stream and the
engines' completion records name (client copies are stripped by the bootstrap).
``x-prefiller-host-port`` is llm-d's: the prefill engine the EPP picked for a
disaggregated request, read by the decode engine. ``x-infergate-priority`` is ours: the
InferenceObjective's priority in vLLM's convention (negated), which the engine schedules
by when the body has no ``priority`` of its own. ``x-infergate-order-delay`` is ours too:
seconds the engine adds to the request's arrival where it orders its waiting queue under
priority scheduling (the EPP's predicted prefill work, weighted).
"""

DESTINATION_HEADER = "x-gateway-destination-endpoint"
"""Header (and ``envoy.lb`` metadata key) carrying the EPP's pick, per GIE's protocol."""
SERVED_HEADER = "x-gateway-destination-endpoint-served"
"""GIE's served endpoint: Envoy reports it to the EPP in ``envoy.lb`` metadata."""
LB_METADATA_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
REQUEST_ID_HEADER = "x-infergate-request-id"
"""The EPP's id for a routed request (observer stream, engines' completion records)."""
PREFILL_HEADER = "x-prefiller-host-port"
"""llm-d's header: the prefill engine the EPP picked, ``host:port`` of its HTTP server."""
PRIORITY_HEADER = "x-infergate-priority"
"""The engine priority the EPP asks for: minus the InferenceObjective's priority (GIE: higher
is more important; vLLM: lower runs first). A body's own ``priority`` takes precedence."""
ORDER_DELAY_HEADER = "x-infergate-order-delay"
"""Seconds the engine adds to the request's arrival time where it orders its waiting queue
under ``--scheduling-policy priority``, within the request's priority: the EPP sets it to its
``engineOrderWeight`` x the request's predicted prefill on the picked engine, so a short
prefill overtakes a long one that arrived less than the difference earlier (docs/epp.md).
Client copies are stripped by the bootstrap."""
MAX_ORDER_DELAY_S = 3600.0
"""The largest ``x-infergate-order-delay`` an engine takes: an hour is beyond any prefill."""
PREFIX_HEADER = "x-infergate-prefix"
"""The prompt's approximate-prefix block hashes, set by the EPP that routed a request; the
engine echoes them in its admission record so every EPP replica learns where the prefix
went (:mod:`infergate.wire.completions`). Client copies are stripped by the bootstrap."""

MAX_REQUEST_BODY_BYTES = 8 << 20
"""The largest request body the EPP takes by default (``--max-request-body-bytes``), and
what Envoy buffers per request when bodies reach the EPP buffered."""
