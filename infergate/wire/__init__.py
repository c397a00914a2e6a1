"""The formats the engine, Envoy's config and the Endpoint Picker agree on, in one place.

Each side imports these modules and nothing of the other side, so the EPP never loads
engine code (and with it torch), and the engine never loads Envoy or EPP code:

* :mod:`~infergate.wire.names` — header and dynamic-metadata names (GIE's Endpoint Picker
  protocol, llm-d's prefill header, the EPP's request id);
* :mod:`~infergate.wire.completions` — the completion records an engine publishes and the
  EPP subscribes to;
* :mod:`~infergate.wire.load` — the load reports an engine pushes on the same socket, so
  the EPP need not scrape it;
* :mod:`~infergate.wire.block_hash` — the chained KV-block hash the engine's KV events
  carry and the EPP's precise-prefix index recomputes;
* :mod:`~infergate.wire.responses` — Responses API ids that carry the route tag of the
  engine that holds a conversation, for ``previous_response_id`` affinity.

Dependencies stay light on purpose (the standard library, ``msgspec``, ``xxhash``): the
EPP's image installs neither torch nor the engine's other requirements.
"""
