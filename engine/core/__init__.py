"""The engine core, as in vLLM v1 (``vllm/v1/core/``): the step loop (:mod:`.engine_core`),
the scheduler and its waiting queue, the KV cache manager over the block pool, and the
request state machine.

Nothing here knows HTTP or the model: :mod:`infergate.engine.entrypoints` sits above it,
and a model runner (real or simulated) sits behind the ``ModelRunner`` interface in
:mod:`infergate.engine.interfaces`. Import the modules, not this package: it re-exports
nothing, so importing one part does not load the others.
"""
