"""The vLLM-compatible inference engine (imports as ``infergate.engine``)."""
