"""Prefill/decode disaggregation: handing a prompt's KV cache from one engine to another.

* :mod:`.config` — ``--kv-transfer-config`` (vLLM's JSON shape).
* :mod:`.connector` — the transport interface (what a NIXL/RDMA transport would implement)
  and the wire format of a pulled payload.
* :mod:`.zmq_connector` — infergate's own transport over ZeroMQ (TCP).
* :mod:`.blocks` — the engine-thread side: holding a finished prefill's blocks until they
  are pulled (or a timeout), and committing pulled blocks into the decode engine's pool.
* :mod:`.tensors` — copying blocks out of / into the runner's per-layer KV tensors.
* :mod:`.remote_prefill` — the decode engine's side of llm-d's sidecar flow: ask the
  prefill engine named in ``x-prefiller-host-port`` to prefill, then pull its KV.
"""
